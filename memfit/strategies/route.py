"""Route a model's own calls through a backend's wrapper, so one ``train_step`` serves every strategy.

DDP's reducer, DeepSpeed's engine (ZeRO-3 parameter gathering, its autocast) and colossalai's
boosted model do their work in *their* forward, yet ``train_step`` is the user's model's method
and calls ``self(...)``. :func:`route_forward` makes ``model(...)`` call the wrapper; the wrapper
calls the model back, and that inner call runs the model as usual: its hooks and ``forward``, once.
The switch sits in front of ``nn.Module._call_impl`` (an instance attribute that shadows the
class's), so the model's own hooks — the ones ZeRO-3 installs included — are not entered by the
outer call. Lightning Fabric redirects forward methods the same way (``_FabricModule``); MMEngine
instead writes a second ``train_step`` on each wrapper class, which is what memfit avoids.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

_ROUTE = "_call_impl"  # the attribute nn.Module.__call__ looks up on the instance


class _Route:
    """The instance ``_call_impl``: outer calls go through ``wrapper``, its call back runs the model."""

    def __init__(self, model: nn.Module, wrapper: nn.Module, when: Callable[[], bool] | None,
                 prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None,
                 compiled: Callable[..., Any] | None = None) -> None:
        self.model = model
        self.wrapper = wrapper
        self.when = when
        self.prepare = prepare
        self.compiled = compiled  # the model's whole-model torch.compile (Module.compile), run as the inner call
        self.call = compiled or types.MethodType(nn.Module._call_impl, model)  # hooks + forward, as usual
        self.inside = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside or (self.when is not None and not self.when()):
            return self.call(*args, **kwargs)
        if self.wrapper.training != self.model.training:
            self.wrapper.train(self.model.training)
        if self.prepare is not None:
            args, kwargs = self.prepare(args, kwargs)
        self.inside = True
        try:
            return self.wrapper(*args, **kwargs)
        finally:
            self.inside = False

    def __deepcopy__(self, memo: dict) -> Any:
        # A copy of the model (an EMA copy, say) runs as a plain module, not through this wrapper.
        clone = memo.get(id(self.model), self.model)
        return types.MethodType(nn.Module._call_impl, clone)


def route_forward(model: nn.Module, wrapper: nn.Module, when: Callable[[], bool] | None = None,
                  prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None = None) -> nn.Module:
    """Make ``model(...)`` (and so ``model.train_step``/``val_step``) run through ``wrapper``, which
    must call ``model`` exactly once per forward. ``when``: route only while it returns True (DDP:
    only with gradients enabled, so evaluation issues no collectives); ``prepare(args, kwargs)``
    transforms the inputs first (DeepSpeed's ``inputs_to_half``). A model compiled whole (``Module.compile``,
    whose compiled call ``nn.Module.__call__`` would run instead of the route) keeps it as the inner call:
    the wrapper runs eagerly around the compiled model. Returns ``model``."""
    unroute(model)
    compiled = model.__dict__.pop("_compiled_call_impl", None)
    model.__dict__[_ROUTE] = _Route(model, wrapper, when, prepare, compiled)
    return model


def unroute(model: nn.Module) -> None:
    """Undo :func:`route_forward` (a whole-model compile is the model's own call again)."""
    route = model.__dict__.pop(_ROUTE, None)
    if isinstance(route, _Route) and route.compiled is not None:
        model._compiled_call_impl = route.compiled


def routed_wrapper(model: nn.Module) -> nn.Module | None:
    """The wrapper ``model``'s calls are routed through, if any."""
    route = model.__dict__.get(_ROUTE)
    return route.wrapper if isinstance(route, _Route) else None
