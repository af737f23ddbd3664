"""One process on one device (CUDA when there is one, else CPU)."""

from __future__ import annotations

from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities


@STRATEGIES.register()
class SingleDeviceStrategy(Strategy):
    """Train in this process on its device. The base class already does everything needed."""

    capabilities = Capabilities(config_hint="strategy='single' (SingleDeviceStrategy)")
