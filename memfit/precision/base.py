"""The Precision interface, and full precision (fp32).

A Precision answers, for every strategy alike: which context the forward runs in (autocast or
none), how the loss is scaled before backward, how the optimizer steps (through a GradScaler or
directly), how the model is converted before it is wrapped (fp32 islands, whole-model casts), and
what state it checkpoints. Strategies hold one and call it; they never parse dtypes themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
}
# VISSL/Apex opt levels: O1 is autocast; O2/O3 are whole-model half (Runner(precision=dict(opt_level=...)):
# memfit.precision.master; DeepSpeed's amp section maps every level to autocast).
APEX_OPT_LEVELS = {"O0": "float32", "O1": "float16", "O2": "float16", "O3": "float16"}


def parse_dtype(value: str | torch.dtype | None, key: str = "dtype") -> torch.dtype | None:
    """'bfloat16' / 'bf16' / torch.bfloat16 / 'bf16-mixed' -> torch dtype (None stays None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removesuffix("-mixed").removesuffix("-true").removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"{key}={value!r}: use 'float16', 'bfloat16' or 'float32'")
    return _DTYPES[name]


CPU_BF16_ENV = "MEMFIT_CPU_BF16"  # '1' / '0': force the answer of cpu_has_native_bf16 (tests, odd CPUs)


def cpu_has_native_bf16() -> bool:
    """True where this CPU computes bf16 natively (AVX512-BF16 or AMX, as oneDNN reports it). Elsewhere
    (AVX2 laptops, most CI runners) bf16 is emulated: autocast was measured 6.5x slower than fp32."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None and forced.strip():
        return forced.strip().lower() in ("1", "true", "yes", "on")
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_amp_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when none is given: fp16 on CUDA (tensor cores, as in MMEngine's guides and
    MMDetection's large-model example); on CPU bf16 where the CPU has it natively, else None (stay fp32:
    emulated bf16 only costs time)."""
    log = logging.getLogger("memfit")
    if device_type == "cuda":
        dtype = torch.float16
    elif cpu_has_native_bf16():
        dtype = torch.bfloat16
    else:
        log.warning(f"AmpOptimWrapper: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16, where "
                    "autocast runs several times slower than fp32: training stays in fp32. Set "
                    f"optim_wrapper.dtype='bfloat16' to use it anyway (its memory savings hold), or {CPU_BF16_ENV}=1")
        return None
    log.info(f"AmpOptimWrapper: dtype not set, using {dtype_name(dtype)} on {device_type}")
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str:
    """torch.bfloat16 -> 'bfloat16' (None -> 'float32')."""
    return str(dtype or torch.float32).removeprefix("torch.")


class Precision:
    """Full precision: no autocast, no loss scaling. The base of every precision policy."""

    name = "fp32"
    dtype: torch.dtype | None = None  # the compute dtype of the forward (None: float32)

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def to_device(self, device: torch.device) -> None:
        """Called by the strategy once it knows its device (autocast and scalers are per device)."""
        self.device_type = device.type

    # -- the model ---------------------------------------------------------------------------
    def convert_module(self, model: nn.Module) -> nn.Module:
        """Prepare ``model`` before the strategy wraps it (fp32 islands, casts). In place."""
        return model

    def prepare_optimizer(self, optim_wrapper: Any) -> None:
        """Called once the optimizer wrapper is built over the wrapped model, before the strategy's
        ``setup`` (ZeRO-1 shards what this leaves in the optimizer): fp32 master weights go in here."""

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """The context the training forward runs in."""
        return contextlib.nullcontext()

    def eval_autocast(self, half: bool = False) -> Any:
        """The context an evaluation forward runs in: fp32 unless the loop asks for ``half``
        (MMEngine's ``val_cfg=dict(fp16=True)``), then this policy's dtype or the device's AMP one."""
        if not half:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.dtype if self.dtype in (torch.float16, torch.bfloat16)
                              else None)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping (a GradScaler's unscale_)."""

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        optimizer.step(**kwargs)

    def zero_grad(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """Clear the gradients (a precision with master weights clears the model's half ones too)."""
        optimizer.zero_grad(**kwargs)

    # -- logging and state -------------------------------------------------------------------
    def log_scalars(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Entries merged into the optimizer wrapper's checkpoint state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
