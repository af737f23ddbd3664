"""fp32 islands: run chosen modules in float32, with autocast off, inside a mixed-precision model.

``AmpOptimWrapper(..., fp32_modules=['MultiScaleDeformableAttention', 'loss'])``: numerically
sensitive parts (deformable attention's sampling, losses with exp/log, softmax over many classes)
keep fp32 while the rest of the model runs in fp16/bf16. Each entry of the spec matches modules by

- qualified name (``'bbox_head.loss_cls'``), or its last components (``'loss'`` matches
  ``'head.loss'``; ``'head.loss'`` matches ``'model.head.loss'``),
- class name (``'MultiScaleDeformableAttention'``, also a base class name),
- a glob over the qualified name when the entry has ``*?[`` (``'*.loss_*'``).

A matched module keeps its identity (hooks, ``state_dict`` keys, FSDP/checkpoint wrapping all
see the same object); only its ``forward`` is replaced on the instance by one that casts floating
tensor inputs (nested in lists, tuples and dicts; float64 kept) to float32 and runs the original
forward with autocast disabled. Outputs stay float32: the next autocast op casts them down again.
Outside autocast the original forward runs untouched. A module inside an island is not wrapped
again (the outer island already covers it).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.errors import ConfigError, did_you_mean

_MARK = "_memfit_fp32_island"


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
        return x.float()
    return x


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
    first = next(module.parameters(), None)
    return first.device.type if first is not None else "cpu"


def _island_forward(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    device = _device_type(module, args, kwargs)
    if not torch.is_autocast_enabled(device):
        return forward(*args, **kwargs)
    args, kwargs = tree_map(_to_fp32, (args, kwargs))
    with torch.autocast(device, enabled=False):
        return forward(*args, **kwargs)


def _matches(entry: str, name: str, module: nn.Module) -> bool:
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(name, entry)
    if name == entry or name.endswith("." + entry):
        return True
    return any(cls.__name__ == entry for cls in type(module).__mro__ if cls not in (nn.Module, object))


def apply_fp32_islands(model: nn.Module, spec: list[str]) -> list[str]:
    """Run the modules ``spec`` names in float32 with autocast off; return their qualified names.

    ``spec`` entries are module names, name suffixes, class names or globs (see the module doc).
    An entry matching no module raises ConfigError with the nearest module and class names.
    """
    if isinstance(spec, str):
        spec = [spec]
    named = list(model.named_modules())
    hits: set[str] = set()
    for entry in spec:
        found = {n for n, m in named if _matches(entry, n, m)}
        if not found:
            candidates = {n for n, _ in named if n} | {n.rsplit(".", 1)[-1] for n, _ in named if n}
            candidates |= {type(m).__name__ for _, m in named}
            raise ConfigError(f"fp32_modules: {entry!r} matches no module name or type: "
                              f"{did_you_mean(entry, candidates)}")
        hits |= found
    # A module inside another island already runs with autocast off: wrapping it too would only
    # cast its inputs again. Islands from an earlier call count as enclosing ones.
    enclosing = hits | {n for n, m in named if getattr(m, _MARK, False)}
    outer = []
    for name, module in named:
        if name in hits and not any(o == "" or name.startswith(o + ".") for o in enclosing if o != name):
            outer.append(name)
            if not getattr(module, _MARK, False):
                module.forward = functools.partial(_island_forward, module, module.forward)
                setattr(module, _MARK, True)
    return outer
