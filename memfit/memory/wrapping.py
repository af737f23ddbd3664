"""Replacing a module's ``forward`` by a memfit wrapper, never twice: the mechanism activation checkpointing
and activation offload share (:mod:`memfit.memory.checkpointing`, :mod:`memfit.memory.offload`).

Each chosen module keeps its identity: only its ``forward`` is replaced, by an instance attribute, so
parameter names, ``state_dict`` keys and module hooks stay as they were. A module inside or around one
already wrapped, or covered by the model's own checkpointing switch, is skipped with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from memfit.errors import ConfigError, did_you_mean

logger = logging.getLogger("memfit")

# Attributes by which models switch on their own checkpointing: timm (grad_checkpointing),
# OpenMMLab (with_cp), Hugging Face (gradient_checkpointing), Swin/official repos (use_checkpoint).
OWN_SWITCHES = ("grad_checkpointing", "with_cp", "gradient_checkpointing", "use_checkpoint")


class WrappedForward:
    """A module's replacement ``forward``: calls the original inside a context.

    A class, not a closure: ``copy.deepcopy(model)`` (EMA, SWA) then copies the bound original
    forward with the module it belongs to, instead of sharing the old module's method.
    Subclasses define ``__call__``; ``kind`` names the technique in warnings.
    """

    kind = "wrapped"

    def __init__(self, orig: Callable[..., Any]) -> None:
        self.orig = orig


def wrapped_forward(module: nn.Module) -> WrappedForward | None:
    """The memfit wrapper installed on ``module.forward``, or None."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, WrappedForward) else None


def own_switch(module: nn.Module) -> str | None:
    """The name of the model's own checkpointing attribute that is on for ``module``, or None."""
    for attr in OWN_SWITCHES:
        if getattr(module, attr, False) is True:
            return attr
    return None


def resolve_modules(model: nn.Module, names: Iterable[str], key: str) -> list[tuple[str, nn.Module]]:
    """Look qualified names up in ``model``; an unknown name is a ConfigError with near matches.

    A ``ModuleList``/``ModuleDict`` has no forward of its own, so its name stands for each of its
    children (``'encoder.layers'`` is every encoder layer, as MMDetection's ``num_cp`` does).
    """
    table = dict(model.named_modules())
    out = []
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"{key}: module names must be strings, got {name!r}")
        if name not in table:
            raise ConfigError(f"{key}: model has no module {name!r}: {did_you_mean(name, table)}")
        module = table[name]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out.extend((f"{name}.{child}" if name else child, m) for child, m in module.named_children())
        else:
            out.append((name, module))
    return out


def _within(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _covered(modules: dict[str, nn.Module], name: str) -> str:
    # timm's switch on a model or stage checkpoints its ``blocks`` only (patch_embed, norms and the
    # head are not recomputed); any other model's switch is taken to cover the whole module.
    blocks = getattr(modules[name], "blocks", None)
    if isinstance(blocks, nn.Module) and getattr(modules[name], "grad_checkpointing", False) is True:
        return f"{name}.blocks" if name else "blocks"
    return name


def install(
    model: nn.Module,
    chosen: list[tuple[str, nn.Module]],
    make: Callable[[Callable[..., Any]], WrappedForward],
    what: str,
    makers: dict[str, Callable[[Callable[..., Any]], WrappedForward]] | None = None,
) -> list[str]:
    """Replace the forward of each chosen module by ``make(original forward)``, never twice.

    ``makers`` overrides ``make`` for the qualified names it holds (a split Sequential among named
    modules), so one call orders all of them outermost first.

    Skipped with a warning: a module already wrapped by memfit or inside/around one that is (the
    checkpoint or offload of the outer one would act on the inner one twice), and a module that the
    model's own checkpointing switch covers. Returns the qualified names that were wrapped.
    """
    modules = dict(model.named_modules())
    wrapped = {n for n, m in modules.items() if wrapped_forward(m) is not None}
    switched = {n for n, m in modules.items() if own_switch(m) is not None}
    done: list[str] = []
    # Outermost first, so that a module inside another chosen one is the one skipped.
    for name, module in sorted(chosen, key=lambda nm: nm[0].count(".") + (nm[0] != "")):
        clash = next((w for w in sorted(wrapped) if _within(name, w) or _within(w, name)), None)
        if clash is not None:
            tech = wrapped_forward(modules[clash]).kind  # type: ignore[union-attr]
            where = "is" if clash == name else ("is inside" if _within(name, clash) else "contains")
            logger.warning(
                f"{what}: skipping {name or '<model>'!r}: it {where} {clash or '<model>'!r}, "
                f"which already has {tech}"
            )
            continue
        own = next(
            (s for s in sorted(switched) if _within(name, _covered(modules, s)) or _within(s, name)), None
        )
        if own is not None:
            attr = own_switch(modules[own])
            logger.warning(
                f"{what}: skipping {name or '<model>'!r}: the model's own checkpointing "
                f"({own or '<model>'}.{attr}=True) already covers it; recomputing it again would "
                f"run its forward twice more"
            )
            continue
        module.forward = (makers or {}).get(name, make)(module.forward)
        wrapped.add(name)
        done.append(name)
    return done
