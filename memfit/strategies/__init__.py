"""Strategies: one interface (base.Strategy), one backend per module."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.single import SingleDeviceStrategy

# Lightning-style short names -> strategy configs (later issues add DDP/FSDP/DeepSpeed entries).
SHORT_NAMES: dict[str, dict[str, Any]] = {
    "single": dict(type="SingleDeviceStrategy"),
    "single_device": dict(type="SingleDeviceStrategy"),
}


def build_strategy(cfg: Any) -> Strategy:
    """A Strategy from an object, a dict with ``type`` or a short name such as 'ddp'."""
    if cfg is None:
        return SingleDeviceStrategy()
    if isinstance(cfg, Strategy):
        return cfg
    if isinstance(cfg, str):
        if cfg in SHORT_NAMES:
            cfg = SHORT_NAMES[cfg]
        elif cfg in STRATEGIES:
            cfg = dict(type=cfg)
        else:
            from memfit.errors import did_you_mean

            raise ConfigError(f"unknown strategy {cfg!r}: {did_you_mean(cfg, list(SHORT_NAMES) + STRATEGIES.names())}")
    return STRATEGIES.build(cfg, key="strategy")


__all__ = ["Strategy", "SingleDeviceStrategy", "build_strategy", "SHORT_NAMES"]
