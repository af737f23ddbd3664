"""Hooks: the base class and memfit's built-in hooks (registered by name for configs)."""

from memfit.hooks.base import Hook
from memfit.hooks.checkpoint import CheckpointHook
from memfit.hooks.invalid_loss import CheckInvalidLossHook
from memfit.hooks.logger import LoggerHook
from memfit.hooks.memory import MemoryMonitorHook
from memfit.hooks.param_scheduler import ParamSchedulerHook
from memfit.hooks.preemption import PreemptionHook
from memfit.hooks.runtime_info import RuntimeInfoHook
from memfit.hooks.sampler_seed import DistSamplerSeedHook
from memfit.hooks.timer import IterTimerHook
from memfit.hooks.visualization import (
    DetVisualizationHook,
    NaiveVisualizationHook,
    SegVisualizationHook,
    TrackVisualizationHook,
    VisualizationHook,
)

__all__ = ["Hook", "CheckInvalidLossHook", "CheckpointHook", "RuntimeInfoHook", "LoggerHook", "ParamSchedulerHook",
           "DistSamplerSeedHook", "IterTimerHook", "MemoryMonitorHook", "PreemptionHook", "DetVisualizationHook",
           "NaiveVisualizationHook", "SegVisualizationHook", "TrackVisualizationHook", "VisualizationHook"]
