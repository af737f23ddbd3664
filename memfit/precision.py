"""The precision policy: which dtype the forward runs in and whether losses are scaled.

One object answers both questions for every strategy, so precision stays its own axis: fp32, bf16
autocast (no scaler) or fp16 autocast with a GradScaler. VISSL/Apex opt levels map onto these
(O1 -> fp16 autocast; O2/O3 also map to fp16 autocast: memfit never casts the whole model).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from memfit.errors import ConfigError

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
}
APEX_OPT_LEVELS = {"O0": "float32", "O1": "float16", "O2": "float16", "O3": "float16"}


def parse_dtype(value: str | torch.dtype | None, key: str = "dtype") -> torch.dtype | None:
    """'bfloat16' / 'bf16' / torch.bfloat16 / 'bf16-mixed' -> torch dtype (None stays None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removesuffix("-mixed").removesuffix("-true").removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"{key}={value!r}: use 'float16', 'bfloat16' or 'float32'")
    return _DTYPES[name]


class Precision:
    """Autocast context and grad scaler for one device type."""

    def __init__(self, dtype: torch.dtype | None, device_type: str) -> None:
        self.dtype = dtype
        self.device_type = device_type

    @property
    def mixed(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    def autocast(self) -> Any:
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(self, loss_scale: str | float | dict = "dynamic") -> torch.amp.GradScaler | None:
        """A GradScaler for fp16 only (bf16 has fp32's range). ``loss_scale`` follows MMEngine."""
        if self.dtype is not torch.float16:
            return None
        if loss_scale == "dynamic":
            kwargs: dict[str, Any] = {}
        elif isinstance(loss_scale, (int, float)):
            # A static scale: never grow, never back off.
            kwargs = dict(init_scale=float(loss_scale), growth_factor=1.0, backoff_factor=1.0)
        elif isinstance(loss_scale, dict):
            kwargs = dict(loss_scale)
        else:
            raise ConfigError(f"optim_wrapper.loss_scale={loss_scale!r}: use 'dynamic', a number or a dict")
        return torch.amp.GradScaler(self.device_type, **kwargs)


def default_amp_dtype(device_type: str) -> torch.dtype:
    """fp16 on CUDA (tensor cores, the seeds' setting), bf16 elsewhere (CPU has no fast fp16 GEMM)."""
    dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    logging.getLogger("memfit").info(f"AmpOptimWrapper: dtype not set, using {dtype} on {device_type}")
    return dtype
