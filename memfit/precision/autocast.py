"""Mixed precision by autocast: bf16 (no scaler) or fp16 with a GradScaler; fp32 islands.

Parameters, gradients, optimizer state and the loss stay fp32; only the ops autocast lists run in
half. fp16's narrow range needs loss scaling (:class:`memfit.precision.scaler.ScaledPrecision`): the
loss is scaled, the gradients unscaled before clipping, and steps whose gradients overflowed are
skipped (counted, without a host sync).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError, warn_ignored
from memfit.precision.base import Precision, cpu_has_native_bf16, default_amp_dtype, dtype_name
from memfit.precision.scaler import ScaledPrecision, check_loss_scale

logger = logging.getLogger("memfit")


def amp_precision(dtype: torch.dtype | None, device_type: str, loss_scale: str | float | dict = "dynamic",
                  fp32_modules: list[str] | None = None) -> Precision:
    """What ``AmpOptimWrapper`` gets: autocast in ``dtype`` (None: the device's default, which on a
    CPU without native bf16 is fp32 itself); an explicit bf16 on such a CPU is honoured with a warning."""
    check_loss_scale(loss_scale)
    if dtype is None:
        dtype = default_amp_dtype(device_type)
        if dtype is None:
            _unused_loss_scale(loss_scale, "this CPU's default is float32 (no bf16 autocast without native bf16)")
            return Precision(device_type)
    elif device_type == "cpu" and dtype is torch.bfloat16 and not cpu_has_native_bf16():
        logger.warning(f"bfloat16 autocast on this CPU ({torch.backends.cpu.get_cpu_capability()}) is emulated: its "
                       "memory savings hold, its speed does not (measured 6.5x slower than fp32)")
    if dtype is torch.bfloat16:
        _unused_loss_scale(loss_scale, "bfloat16 has float32's range and is trained without loss scaling")
    return AutocastPrecision(dtype, device_type, loss_scale, fp32_modules)


def _unused_loss_scale(loss_scale: Any, why: str) -> None:
    """A loss_scale set for a run that scales nothing: said once (the value was checked all the same)."""
    if loss_scale != "dynamic":
        warn_ignored(f"optim_wrapper.loss_scale={loss_scale!r}", f"{why}: remove it, or set "
                     "optim_wrapper.dtype='float16' to train with a scaled loss")


class AutocastPrecision(ScaledPrecision):
    """``dtype`` float16 or bfloat16; ``loss_scale`` 'dynamic', a number or GradScaler kwargs (fp16
    only); ``fp32_modules`` run in float32 with autocast off (see :mod:`memfit.precision.fp32_islands`)."""

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu", loss_scale: str | float | dict = "dynamic",
                 fp32_modules: list[str] | None = None) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"optim_wrapper.dtype={dtype_name(dtype)!r}: autocast takes 'float16' or 'bfloat16'")
        super().__init__(dtype, device_type, loss_scale)
        self.name = f"{'bf16' if dtype is torch.bfloat16 else 'fp16'}-mixed"
        self.fp32_modules = list(fp32_modules or [])

    def convert_module(self, model: nn.Module) -> nn.Module:
        if self.fp32_modules:
            from memfit.precision.fp32_islands import apply_fp32_islands

            matched = apply_fp32_islands(model, self.fp32_modules)
            shown = ", ".join(matched[:6]) + (f", ... ({len(matched)} in all)" if len(matched) > 6 else "")
            logger.info(f"fp32 islands under autocast: {shown}")
        return model

    def autocast(self) -> Any:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)
