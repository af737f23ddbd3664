"""Speed levers: switches that change how fast a step runs, not what it computes (within rounding).

Each is a config switch applied by :func:`memfit.connector.setup` in torchtitan's order (strategy.to_device
-> memory techniques -> channels_last -> precision.convert_module -> compile -> strategy.wrap -> optimizer):

* ``compile=True`` (Runner's top-level key): regional ``torch.compile`` of the repeated blocks
  (:mod:`memfit.speed.compile`); ``compile=dict(regional=False, backend=..., mode=...)`` for the whole model.
* ``channels_last=True`` (technique key): NHWC weights and images (:mod:`memfit.speed.channels_last`).
* ``tf32=True|False`` (technique key): TF32 matmuls and convolutions, process-wide (:mod:`memfit.speed.tf32`).
* ``optim_wrapper.optimizer.fused=True``: torch's fused optimizer step, checked where the optimizer is
  built (:mod:`memfit.speed.fused`).
* ``env_cfg.cudnn_benchmark=True``: cuDNN's algorithm search, set with the device (:mod:`memfit.speed.cudnn`).

See docs/speed.md.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import ConfigTypeError
from memfit.speed.channels_last import apply_channels_last, to_channels_last
from memfit.speed.compile import apply_compile, check_compiler, compile_options, compiled_modules
from memfit.speed.cudnn import apply_cudnn_benchmark
from memfit.speed.fused import check_fused
from memfit.speed.tf32 import apply_tf32, check_tf32


def check_speed_levers(techniques: dict | None, compile: Any, device: torch.device) -> dict[str, Any] | None:
    """Check the levers of a run on ``device`` before anything is built, one ConfigError line each, and set
    the process-wide TF32 flags (``techniques['tf32']``); returns the compile options (None: no compile)
    for :func:`apply_compile`."""
    techniques = techniques or {}
    channels_last = techniques.get("channels_last")
    if channels_last is not None and not isinstance(channels_last, bool):
        raise ConfigTypeError(f"channels_last must be True or False, got {channels_last!r}")
    options = compile_options(compile)
    if options is not None:
        check_compiler(options, device)
    apply_tf32(techniques.get("tf32"), device)
    return options


__all__ = ["apply_channels_last", "apply_compile", "apply_cudnn_benchmark", "apply_tf32", "check_compiler",
           "check_fused", "check_speed_levers", "check_tf32", "compile_options", "compiled_modules",
           "to_channels_last"]
