"""Loss scaling for half-precision training: the GradScaler part that autocast fp16 and whole-model fp16
(Apex O2/O3) share.

fp16's narrow range needs the loss scaled up before backward and the gradients scaled back before
clipping and stepping; a step whose gradients overflowed is skipped (counted as a tensor, without a
host sync) and, with a dynamic scale, the scale halves. bf16 has fp32's range: no scaler.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from memfit.errors import ConfigError, did_you_mean, type_or_value_error
from memfit.precision.base import Precision


def check_loss_scale(loss_scale: Any, key: str = "optim_wrapper.loss_scale") -> None:
    """'dynamic', a positive number (a fixed scale) or GradScaler keyword arguments (a positive
    ``init_scale``): checked whatever the dtype, so a bad value fails before training, not at fp16's
    first step (or never, with bf16, which scales nothing)."""
    if not (loss_scale == "dynamic" or isinstance(loss_scale, int | float | dict)) or isinstance(loss_scale, bool):
        raise ConfigError(f"{key}={loss_scale!r}: use 'dynamic', a number or a dict")
    if isinstance(loss_scale, dict):
        valid = [n for n in inspect.signature(torch.amp.GradScaler).parameters if n != "device"]
        for name in loss_scale:
            if name not in valid:
                raise ConfigError(f"{key}: unknown key {name!r}: {did_you_mean(str(name), valid)} "
                                  "(the dict holds torch.amp.GradScaler's arguments)")
        if "init_scale" not in loss_scale:
            return
        scale, key = loss_scale["init_scale"], f"{key}.init_scale"
    elif loss_scale == "dynamic":
        return
    else:
        scale = loss_scale
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
        raise type_or_value_error(f"{key}={scale!r}: a fixed scale must be positive (e.g. 512.0), or use 'dynamic'",
                                  not isinstance(scale, int | float))


class ScaledPrecision(Precision):
    """A precision with a ``torch.amp.GradScaler`` when ``dtype`` is float16 (none for bfloat16).

    ``loss_scale``: 'dynamic' (GradScaler's defaults), a number (a fixed scale, set back after every
    step as MMEngine does) or GradScaler keyword arguments. ``skipped_steps`` counts the steps skipped
    because the gradients overflowed.
    """

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu", loss_scale: str | float | dict = "dynamic",
                 key: str = "optim_wrapper.loss_scale") -> None:
        super().__init__(device_type)
        check_loss_scale(loss_scale, key)
        self.dtype = dtype
        self.loss_scale = loss_scale
        self.scaler: torch.amp.GradScaler | None = None
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
