"""Whole-model half precision: parameters cast to fp16/bf16 for compute, fp32 master weights kept by
the backend. What DeepSpeed's ``fp16``/``bf16`` sections and FSDP's ``mixed_precision`` do.

The backend performs the cast (DeepSpeed's engine, FSDP2's MixedPrecisionPolicy); this policy
carries the dtypes to it, so the precision of a run is decided in one place (the connector) and a
strategy only translates it. Unlike autocast, every op runs in half, the loss computed inside the
model included: numerically sensitive ops can overflow or stall (the DINO run of MMDetection's large-model
example).
"""

from __future__ import annotations

import torch

from memfit.errors import ConfigError
from memfit.precision.base import Precision, dtype_name


class HalfPrecision(Precision):
    """``param_dtype`` for compute; ``reduce_dtype`` for gradient reduction (None: the param dtype);
    ``output_dtype``/``cast_forward_inputs`` as FSDP2's MixedPrecisionPolicy."""

    def __init__(self, param_dtype: torch.dtype, reduce_dtype: torch.dtype | None = None,
                 output_dtype: torch.dtype | None = None, cast_forward_inputs: bool = True,
                 device_type: str = "cpu") -> None:
        super().__init__(device_type)
        if param_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ConfigError(f"param_dtype={dtype_name(param_dtype)!r}: use 'float16' or 'bfloat16'")
        self.dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.output_dtype = output_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.name = f"{'bf16' if param_dtype is torch.bfloat16 else 'fp16'}-true"

    def fsdp_policy_kwargs(self) -> dict:
        """The keyword arguments of FSDP2's ``MixedPrecisionPolicy``."""
        out = dict(param_dtype=self.dtype, reduce_dtype=self.reduce_dtype, cast_forward_inputs=self.cast_forward_inputs)
        if self.output_dtype is not None:
            out["output_dtype"] = self.output_dtype
        return out
