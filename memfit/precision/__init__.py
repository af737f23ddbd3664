"""Precision policies: one object per run decides autocast, loss scaling and casts for every strategy.

``Precision`` (fp32), ``AutocastPrecision`` (bf16, or fp16 with a GradScaler; fp32 islands),
``HalfPrecision`` (whole-model half with the backend's fp32 master weights: DeepSpeed fp16/bf16, FSDP
mixed_precision) and ``MasterWeightsPrecision`` (Apex O2/O3: whole-model half with memfit's fp32
masters, single device and DDP). ``memfit.connector`` chooses one from the config and rejects bad
combinations.
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
from memfit.precision.master import MasterWeightsPrecision, precision_from_cfg, precision_options
from memfit.precision.resolve import amp_request, resolve_precision, with_amp
from memfit.precision.scaler import ScaledPrecision

__all__ = ["APEX_OPT_LEVELS", "CPU_BF16_ENV", "AutocastPrecision", "HalfPrecision", "MasterWeightsPrecision",
           "Precision", "ScaledPrecision", "amp_precision", "cpu_has_native_bf16", "default_amp_dtype", "dtype_name",
           "amp_request", "parse_dtype", "precision_from_cfg", "precision_options", "resolve_precision", "with_amp"]
