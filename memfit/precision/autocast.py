"""Mixed precision by autocast: bf16 (no scaler) or fp16 with a GradScaler; fp32 islands.

Parameters, gradients, optimizer state and the loss stay fp32; only the ops autocast lists run in
half. fp16's narrow range needs loss scaling, so a GradScaler scales the loss, unscales the
gradients before clipping and skips steps whose gradients overflowed (counted, without a host sync).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.precision.base import Precision, cpu_has_native_bf16, default_amp_dtype, dtype_name

logger = logging.getLogger("memfit")


def amp_precision(dtype: torch.dtype | None, device_type: str, loss_scale: str | float | dict = "dynamic",
                  fp32_modules: list[str] | None = None) -> Precision:
    """What ``AmpOptimWrapper`` gets: autocast in ``dtype`` (None: the device's default, which on a
    CPU without native bf16 is fp32 itself); an explicit bf16 on such a CPU is honoured with a warning."""
    _check_loss_scale(loss_scale)
    if dtype is None:
        dtype = default_amp_dtype(device_type)
        if dtype is None:
            return Precision(device_type)
    elif device_type == "cpu" and dtype is torch.bfloat16 and not cpu_has_native_bf16():
        logger.warning(f"bfloat16 autocast on this CPU ({torch.backends.cpu.get_cpu_capability()}) is emulated: its "
                       "memory savings hold, its speed does not (measured 6.5x slower than fp32)")
    return AutocastPrecision(dtype, device_type, loss_scale, fp32_modules)


def _check_loss_scale(loss_scale: Any) -> None:
    if not (loss_scale == "dynamic" or isinstance(loss_scale, int | float | dict)) or isinstance(loss_scale, bool):
        raise ConfigError(f"optim_wrapper.loss_scale={loss_scale!r}: use 'dynamic', a number or a dict")


class AutocastPrecision(Precision):
    """``dtype`` float16 or bfloat16; ``loss_scale`` 'dynamic', a number or GradScaler kwargs (fp16
    only); ``fp32_modules`` run in float32 with autocast off (see :mod:`memfit.precision.fp32_islands`)."""

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu", loss_scale: str | float | dict = "dynamic",
                 fp32_modules: list[str] | None = None) -> None:
        super().__init__(device_type)
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"optim_wrapper.dtype={dtype_name(dtype)!r}: autocast takes 'float16' or 'bfloat16'")
        _check_loss_scale(loss_scale)
        self.dtype = dtype
        self.name = f"{'bf16' if dtype is torch.bfloat16 else 'fp16'}-mixed"
        self.loss_scale = loss_scale
        self.fp32_modules = list(fp32_modules or [])
        self.scaler: torch.amp.GradScaler | None = None
        # A fixed scale (MMEngine's loss_scale=512.0): the scale is set back to it after every step.
        self._static_scale = float(loss_scale) if isinstance(loss_scale, int | float) else None
        self.skipped_steps = torch.zeros((), dtype=torch.long)
        self._make_scaler()

    def to_device(self, device: torch.device) -> None:
        if device.type != self.device_type:
            super().to_device(device)
            self._make_scaler()
        self.skipped_steps = self.skipped_steps.to(device)

    def _make_scaler(self) -> None:
        """A GradScaler for fp16 only (bf16 has fp32's range), on this policy's device."""
        if self.dtype is not torch.float16:
            self.scaler = None
            return
        if self.loss_scale == "dynamic":
            kwargs: dict[str, Any] = {}
        elif isinstance(self.loss_scale, dict):
            kwargs = dict(self.loss_scale)
        else:  # a fixed scale: GradScaler.update(new_scale) pins it after every step (as MMEngine does)
            kwargs = dict(init_scale=float(self.loss_scale))
        self.scaler = torch.amp.GradScaler(self.device_type, **kwargs)

    def convert_module(self, model: nn.Module) -> nn.Module:
        if self.fp32_modules:
            from memfit.precision.fp32_islands import apply_fp32_islands

            matched = apply_fp32_islands(model, self.fp32_modules)
            shown = ", ".join(matched[:6]) + (f", ... ({len(matched)} in all)" if len(matched) > 6 else "")
            logger.info(f"fp32 islands under autocast: {shown}")
        return model

    def autocast(self) -> Any:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if self.scaler is None:
            return super().step(optimizer, **kwargs)
        self.scaler.step(optimizer, **kwargs)
        # Overflow found by the scaler (the step was skipped): counted as a tensor, no host sync.
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        self.skipped_steps += (sum(f.to(self.skipped_steps.device) for f in found) > 0).long()
        self.scaler.update(self._static_scale)

    def log_scalars(self) -> dict[str, Any]:
        if self.scaler is None or self.scaler._scale is None:
            return {}
        return {"loss_scale": self.scaler._scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"loss_scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
            if "skipped_steps" in state:  # not in an MMEngine-shaped optimizer wrapper state
                self.skipped_steps = state["skipped_steps"].to(self.skipped_steps.device)
