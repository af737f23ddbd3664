"""Route a model's own forward through a backend's wrapper, so one ``train_step`` serves every strategy.

DDP's reducer, DeepSpeed's engine (ZeRO-3 parameter gathering, its autocast) and colossalai's
boosted model do their work in *their* forward, yet ``train_step`` is the user's model's method
and calls ``self(...)``. :func:`route_forward` installs an instance ``forward`` on the model that
calls the wrapper; the wrapper calls the model back, and that inner call runs the model's real
forward. Lightning Fabric redirects forward methods the same way (``_FabricModule``); MMEngine
instead writes a second ``train_step`` on each wrapper class, which is what memfit avoids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

_ROUTE = "_memfit_route"


class _Route:
    """The instance ``forward``: outer calls go through ``wrapper``, the wrapper's call back runs ``inner``."""

    def __init__(self, model: nn.Module, wrapper: nn.Module, when: Callable[[], bool] | None,
                 prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None) -> None:
        self.model = model
        self.wrapper = wrapper
        self.when = when
        self.prepare = prepare
        # The forward to run inside the wrapper: an instance forward installed before (activation
        # checkpointing of the root, fp32 island) or the class's own.
        self.inner = model.__dict__.get("forward") or type(model).forward.__get__(model)
        self.inside = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside or (self.when is not None and not self.when()):
            return self.inner(*args, **kwargs)
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
        # A copy of the model (an EMA copy, say) runs its own forward, not through this wrapper.
        import copy

        clone = memo.get(id(self.model))
        if clone is None or "forward" not in self.model.__dict__ or self.model.__dict__.get("forward") is not self:
            return None
        if getattr(self.inner, "__self__", None) is self.model:
            return getattr(type(clone), self.inner.__func__.__name__).__get__(clone)
        return copy.deepcopy(self.inner, memo)


def route_forward(model: nn.Module, wrapper: nn.Module, when: Callable[[], bool] | None = None,
                  prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None = None) -> nn.Module:
    """Make ``model(...)`` (and so ``model.train_step``/``val_step``) run through ``wrapper``, which
    must call ``model`` exactly once per forward. ``when``: route only while it returns True (DDP:
    only with gradients enabled, so evaluation issues no collectives); ``prepare(args, kwargs)``
    transforms the inputs first (DeepSpeed's ``inputs_to_half``). Returns ``model``."""
    unroute(model)
    route = _Route(model, wrapper, when, prepare)
    model.forward = route
    object.__setattr__(model, _ROUTE, route)
    return model


def unroute(model: nn.Module) -> None:
    """Undo :func:`route_forward` (restores the forward that was there before)."""
    route = model.__dict__.get(_ROUTE)
    if not isinstance(route, _Route):
        model.__dict__.pop(_ROUTE, None)
        return
    if "forward" in model.__dict__ and model.__dict__["forward"] is route:
        previous = route.inner
        if getattr(previous, "__self__", None) is model and getattr(previous, "__func__", None) is type(model).forward:
            del model.forward
        else:
            model.forward = previous
    del model.__dict__[_ROUTE]


def routed_wrapper(model: nn.Module) -> nn.Module | None:
    """The wrapper ``model``'s forward is routed through, if any."""
    route = model.__dict__.get(_ROUTE)
    return route.wrapper if isinstance(route, _Route) else None
