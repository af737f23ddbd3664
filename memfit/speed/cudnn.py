"""cuDNN's benchmark mode: ``env_cfg=dict(cudnn_benchmark=True)`` (MMEngine's key).

cuDNN times every convolution algorithm for each new input shape on its first call and keeps the
fastest: a gain for a fixed input size (classification crops), a loss for inputs whose size changes
every batch (detection's multi-scale resizes), each new size being timed again. A process-wide flag,
set where the strategy picks the device (:meth:`memfit.strategies.base.Strategy.setup_env`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("memfit")


def apply_cudnn_benchmark(enabled: bool, device: torch.device) -> None:
    """Turn cuDNN's benchmark mode on for a CUDA run; elsewhere one warning line that it has no effect
    (not an error: the same config runs on a GPU and on this device). False leaves torch's setting."""
    if not enabled:
        return
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    else:
        logger.warning(f"env_cfg.cudnn_benchmark=True has no effect on {device.type} (cuDNN is CUDA's); ignored")
