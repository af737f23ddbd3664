"""Precision policies: one object per run decides autocast, loss scaling and casts for every strategy.

``Precision`` (fp32), ``AutocastPrecision`` (bf16, or fp16 with a GradScaler; fp32 islands) and
``HalfPrecision`` (whole-model half with fp32 master weights: DeepSpeed fp16/bf16, FSDP
mixed_precision). ``memfit.connector`` chooses one from the config and rejects bad combinations.
"""

from memfit.precision.autocast import AutocastPrecision, amp_precision
from memfit.precision.base import (
    APEX_OPT_LEVELS,
    CPU_BF16_ENV,
    Precision,
    cpu_has_native_bf16,
    default_amp_dtype,
    dtype_name,
    parse_dtype,
)
from memfit.precision.half import HalfPrecision

__all__ = ["APEX_OPT_LEVELS", "CPU_BF16_ENV", "AutocastPrecision", "HalfPrecision", "Precision", "amp_precision",
           "cpu_has_native_bf16", "default_amp_dtype", "dtype_name", "parse_dtype"]
