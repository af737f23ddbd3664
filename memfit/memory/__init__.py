"""Memory techniques: functions applied to the built model before the strategy wraps it.

``apply_memory_techniques`` reads the seeds' switches from the runner's ``cfg`` and applies each in
an order that composes: Conv-BN folding, activation checkpointing, activation offload, fp32 islands.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn


def _fp32_modules(optim_wrapper_cfg: Any) -> list[str]:
    if isinstance(optim_wrapper_cfg, dict):
        return list(optim_wrapper_cfg.get("fp32_modules") or [])
    return list(getattr(optim_wrapper_cfg, "fp32_modules", None) or [])


def apply_memory_techniques(model: nn.Module, cfg: dict, optim_wrapper_cfg: Any = None,
                            logger: logging.Logger | None = None) -> None:
    """Apply ``efficient_conv_bn_eval``, ``activation_checkpointing``, ``activation_offload`` from ``cfg``
    and the optimizer wrapper's ``fp32_modules`` to ``model`` in place."""
    logger = logger or logging.getLogger("memfit")
    if cfg.get("efficient_conv_bn_eval"):
        from memfit.memory.conv_bn import apply_efficient_conv_bn_eval

        names = cfg["efficient_conv_bn_eval"]
        apply_efficient_conv_bn_eval(model, [names] if isinstance(names, str) else list(names))
    if cfg.get("activation_checkpointing"):
        from memfit.memory.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, cfg["activation_checkpointing"])
    if cfg.get("activation_offload"):
        from memfit.memory.offload import apply_activation_offload

        names = cfg["activation_offload"]
        apply_activation_offload(model, [names] if isinstance(names, str) else list(names))
    islands = _fp32_modules(optim_wrapper_cfg)
    if islands:
        from memfit.memory.fp32_islands import apply_fp32_islands

        matched = apply_fp32_islands(model, islands)
        logger.info(f"fp32 islands under autocast: {_short(matched)}")


def _short(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
