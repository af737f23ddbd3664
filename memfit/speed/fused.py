"""Fused optimizer steps: ``optim_wrapper=dict(optimizer=dict(type='AdamW', lr=..., fused=True))``.

``fused=True`` is torch's own argument of AdamW, Adam, SGD and Adagrad: the whole step of every parameter
runs in one kernel per dtype and device, instead of torch's default ``foreach`` step (a few multi-tensor
kernels, with parameter-sized temporaries between them) or a Python loop over the parameters. It is exact
to rounding: the same update in another order of floating-point operations.

memfit checks it where the optimizer is built (:func:`check_fused`), in one line each: a type without
the argument (``Lars``/``Larc`` and the other timm optimizers), parameters on a device torch has no fused
kernels for, and ``fused=True`` with ``foreach=True``. It composes with AmpOptimWrapper's fp16
GradScaler (torch's scaler hands a fused optimizer the scale and the inf flag, and the step skips
itself on overflow), with ``cfg.optimizer_offload`` (the host optimizer is the fused one; torch's fused
kernels run on the CPU), with ZeRO-1 (its shard's optimizer is built fused) and with FSDP2 for Adam and
AdamW (the kernels step the DTensor shards; torch has no sharding rule for fused SGD or Adagrad, refused
in one line).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from memfit.errors import ConfigError

KEY = "optim_wrapper.optimizer.fused"


def fused_devices() -> list[str]:
    """The device types torch has fused optimizer kernels for (torch 2.11 and 2.14: cuda, cpu, mps, xpu, ...)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


# The fused kernels DTensor (FSDP2's sharded parameters) has sharding rules for (torch 2.11 and 2.14: fused
# SGD and Adagrad fail at the first step with "does not have a sharding strategy").
_SHARDED = ("Adam", "AdamW")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _params(params: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in params:
        out.extend(p["params"] if isinstance(p, dict) else [p])
    return out


def check_fused(cfg: dict, optimizer_class: Any, params: Iterable[Any], host: bool = False) -> None:
    """Raise a one-line ConfigError when ``cfg`` (the optimizer config) asks for ``fused=True`` and
    ``optimizer_class`` over ``params`` (tensors or param groups) cannot run it; nothing otherwise.
    ``host``: the optimizer steps host copies (optimizer offload), so the CPU's kernels are the ones used."""
    fused = cfg.get("fused")
    if fused is None or fused is False:
        return
    if fused is not True:
        raise ConfigError(f"{KEY}={fused!r}: use True (one fused kernel per step) or remove it")
    name = getattr(optimizer_class, "__name__", str(optimizer_class))
    try:
        takes = "fused" in inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ConfigError(f"{KEY}=True: {name} has no fused implementation; remove fused or use AdamW/Adam/SGD")
    if cfg.get("foreach"):
        raise ConfigError(f"{KEY}=True and optim_wrapper.optimizer.foreach=True: a step is one or the other; "
                          "remove foreach")
    if cfg.get("differentiable"):
        raise ConfigError(f"{KEY}=True and optim_wrapper.optimizer.differentiable=True: the fused kernels are not "
                          "differentiable; remove one of them")
    if name not in _SHARDED and any(_is_dtensor(p) for p in _params(params)):
        raise ConfigError(f"{KEY}=True: FSDP's sharded parameters have fused kernels for {' and '.join(_SHARDED)} "
                          f"only (torch has no sharding rule for fused {name}); remove fused or use AdamW")
    supported = fused_devices()
    devices = {"cpu"} if host else {p.device.type for p in _params(params)}
    unsupported = sorted(devices - set(supported))
    if unsupported:
        raise ConfigError(f"{KEY}=True: torch has no fused {name} kernels on {', '.join(unsupported)} (it has them on "
                          f"{', '.join(supported)}); remove fused")
