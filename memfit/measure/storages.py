"""What holds memory in a training step: the storages behind (nested) tensors, an optimizer's state,
the parameters it steps, and FSDP2's per-parameter records. Shared by the tracker
(:mod:`memfit.measure.tracker`) and the planner."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # torch built without distributed
    _FSDPModule = None


def storages(obj: Any) -> Iterable[torch.UntypedStorage]:
    """The untyped storages behind every tensor in a (nested) structure, in order; wrapper subclasses unwrapped.

    Runs for every operator, so it walks lists, tuples and dicts itself (operator arguments hold no
    other containers) instead of through pytree, and unwraps only tensor subclasses that flatten."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.layout is torch.strided:
                if _flattens(type(x)):
                    yield from get_untyped_storages(x)
                else:
                    yield x.untyped_storage()
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))  # in order: an operator's outputs as its kernel allocates them
        elif isinstance(x, dict):
            stack.extend(reversed(x.values()))


@functools.cache
def _flattens(cls: type) -> bool:
    return hasattr(cls, "__tensor_flatten__")


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The state tensors an optimizer keeps on the device (an offloaded one keeps none there)."""
    if optimizer is None or is_host_resident(optimizer):
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def is_host_resident(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` keeps its state and steps in host memory (:mod:`memfit.optim.offload`)."""
    return bool(getattr(optimizer, "host_resident", False))


def host_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What an offloaded optimizer keeps in host memory between steps: its parameter copies and state."""
    if not is_host_resident(optimizer):
        return []
    host = getattr(optimizer, "host_optimizer", optimizer)
    state = [v for s in host.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return stepped_params(host) + state


def stepped_params(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []


def fsdp_params(model: nn.Module | None) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) in ``model``: they hold the unsharded gradients, which
    are no registered parameter's ``.grad`` once the module is resharded. Private torch API, read
    defensively (torch 2.14 has ``_fsdp_param_groups``, earlier versions ``_fsdp_param_group``)."""
    out: list[Any] = []
    for module in model.modules() if model is not None and _FSDPModule is not None else ():
        if isinstance(module, _FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            out += [fsdp_param for group in groups if group is not None for fsdp_param in group.fsdp_params]
    return out
