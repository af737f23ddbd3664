"""One process on one device (CUDA when there is one, else CPU)."""

from __future__ import annotations

from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy


@STRATEGIES.register()
class SingleDeviceStrategy(Strategy):
    """Train in this process on its device. The base class already does everything needed."""
