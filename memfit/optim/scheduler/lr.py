"""MMEngine's learning-rate schedulers: the generic schedulers with ``param_name='lr'``."""

from __future__ import annotations

from typing import Any

from memfit.optim.scheduler.base import fixed_param_signature
from memfit.optim.scheduler.param import (
    ConstantParamScheduler,
    CosineAnnealingParamScheduler,
    CosineRestartParamScheduler,
    ExponentialParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    OneCycleParamScheduler,
    PolyParamScheduler,
    StepParamScheduler,
)
from memfit.optim.scheduler.plateau import ReduceOnPlateauParamScheduler
from memfit.registry import PARAM_SCHEDULERS


class LRSchedulerMixin:
    """Fixes ``param_name='lr'``; the class's signature is its scheduler's without ``param_name``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = fixed_param_signature(cls)

    def __init__(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, "lr", *args, **kwargs)


@PARAM_SCHEDULERS.register()
class ConstantLR(LRSchedulerMixin, ConstantParamScheduler):
    """lr x ``factor`` until step ``end - 1``."""


@PARAM_SCHEDULERS.register()
class CosineAnnealingLR(LRSchedulerMixin, CosineAnnealingParamScheduler):
    """Cosine annealing to ``eta_min`` or ``base * eta_min_ratio`` over ``T_max`` (default ``end - begin``)."""


@PARAM_SCHEDULERS.register()
class ExponentialLR(LRSchedulerMixin, ExponentialParamScheduler):
    """lr x ``gamma`` every step."""


@PARAM_SCHEDULERS.register()
class LinearLR(LRSchedulerMixin, LinearParamScheduler):
    """lr x factor, ``start_factor`` -> ``end_factor`` linearly over ``end - begin - 1`` steps."""


@PARAM_SCHEDULERS.register()
class MultiStepLR(LRSchedulerMixin, MultiStepParamScheduler):
    """lr x ``gamma`` at each milestone."""


@PARAM_SCHEDULERS.register()
class StepLR(LRSchedulerMixin, StepParamScheduler):
    """lr x ``gamma`` every ``step_size`` steps."""


@PARAM_SCHEDULERS.register()
class PolyLR(LRSchedulerMixin, PolyParamScheduler):
    """Polynomial decay to ``eta_min``."""


@PARAM_SCHEDULERS.register()
class OneCycleLR(LRSchedulerMixin, OneCycleParamScheduler):
    """The 1cycle policy (``eta_max``, ``total_steps``, ``pct_start``, ``anneal_strategy``, ...)."""


@PARAM_SCHEDULERS.register()
class CosineRestartLR(LRSchedulerMixin, CosineRestartParamScheduler):
    """Cosine annealing with restarts (``periods``, ``restart_weights``)."""


@PARAM_SCHEDULERS.register()
class ReduceOnPlateauLR(LRSchedulerMixin, ReduceOnPlateauParamScheduler):
    """lr x ``factor`` when ``monitor`` stops improving (stepped with the validation metrics)."""
