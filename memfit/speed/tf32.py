"""TF32: fp32 matmuls and convolutions on Tensor Cores with a 10-bit mantissa (Ampere and newer GPUs).

``tf32=True`` (a top-level technique key, or in ``cfg=dict(...)``) turns TF32 on for CUDA matmuls and
cuDNN convolutions; ``tf32=False`` turns both off (full fp32, e.g. for a comparison to the last bit);
absent, torch's defaults stay (matmuls in full fp32, cuDNN convolutions in TF32). Autocast's fp16/bf16
ops are not affected: TF32 is about the ops that stay in fp32.

These are process-wide flags, not a property of the model: they stay set after the run, for every
model in the process. memfit sets them through ``torch.backends.cuda.matmul.allow_tf32`` and
``torch.backends.cudnn.allow_tf32``, which torch 2.11 and 2.14 both read without a warning; setting
the newer ``fp32_precision`` attributes instead would make ``torch.get_float32_matmul_precision()``
and the ``allow_tf32`` reads of other libraries raise (torch refuses to read a mix of the two APIs).
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import ConfigError


def check_tf32(value: Any, device: torch.device) -> None:
    """A one-line ConfigError for a ``tf32`` value that is not a bool, or ``tf32=True`` where there is no
    TF32: a CPU, or a GPU below compute capability 8.0 (Ampere)."""
    if value is None:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"tf32 must be True (TF32 matmuls and convolutions) or False (full fp32), got {value!r}")
    if not value:
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"tf32=True: TF32 is a CUDA GPU feature and this run is on {device.type}; remove tf32")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ConfigError(f"tf32=True: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has "
                          "no TF32 (it needs 8.0, Ampere, or newer); remove tf32")


def apply_tf32(value: bool | None, device: torch.device) -> None:
    """Set TF32 for CUDA matmuls and cuDNN convolutions to ``value`` (process-wide, module docstring);
    None leaves torch's defaults. Checked first by :func:`check_tf32`."""
    check_tf32(value, device)
    if value is None:
        return
    torch.backends.cuda.matmul.allow_tf32 = value
    torch.backends.cudnn.allow_tf32 = value


def tf32_flags() -> tuple[bool, bool]:
    """The current (matmul, cuDNN) TF32 flags, to restore them later."""
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
