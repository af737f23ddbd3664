"""MMEngine's momentum schedulers: SGD's ``momentum``, or ``betas[0]`` of Adam-family optimizers."""

from __future__ import annotations

from typing import Any

from memfit.optim.scheduler.base import fixed_param_signature, optimizer_defaults
from memfit.optim.scheduler.param import (
    ConstantParamScheduler,
    CosineAnnealingParamScheduler,
    CosineRestartParamScheduler,
    ExponentialParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    PolyParamScheduler,
    StepParamScheduler,
)
from memfit.optim.scheduler.plateau import ReduceOnPlateauParamScheduler
from memfit.registry import PARAM_SCHEDULERS


class MomentumSchedulerMixin:
    """Schedules ``momentum``; under an optimizer with ``betas`` (Adam, AdamW, ...) it keeps a
    ``momentum`` entry in each group and writes it back into ``betas[0]`` after every step
    (MMEngine's MomentumSchedulerMixin)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = fixed_param_signature(cls)

    def __init__(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        defaults = optimizer_defaults(optimizer)
        self.use_betas = "momentum" not in defaults and "betas" in defaults
        if "momentum" not in defaults and not self.use_betas:
            raise ValueError("optimizer must support momentum when using momentum scheduler")
        if self.use_betas:
            for group in optimizer.param_groups:
                group["momentum"] = group["betas"][0]
        super().__init__(optimizer, "momentum", *args, **kwargs)

    def step(self, *args: Any) -> None:
        super().step(*args)
        if self.use_betas:
            for group in self.optimizer.param_groups:
                group["betas"] = (group["momentum"], group["betas"][1])


@PARAM_SCHEDULERS.register()
class ConstantMomentum(MomentumSchedulerMixin, ConstantParamScheduler):
    """momentum x ``factor`` until step ``end - 1``."""


@PARAM_SCHEDULERS.register()
class CosineAnnealingMomentum(MomentumSchedulerMixin, CosineAnnealingParamScheduler):
    """Cosine annealing of the momentum."""


@PARAM_SCHEDULERS.register()
class ExponentialMomentum(MomentumSchedulerMixin, ExponentialParamScheduler):
    """momentum x ``gamma`` every step."""


@PARAM_SCHEDULERS.register()
class LinearMomentum(MomentumSchedulerMixin, LinearParamScheduler):
    """momentum x factor, ``start_factor`` -> ``end_factor`` over ``end - begin - 1`` steps."""


@PARAM_SCHEDULERS.register()
class MultiStepMomentum(MomentumSchedulerMixin, MultiStepParamScheduler):
    """momentum x ``gamma`` at each milestone."""


@PARAM_SCHEDULERS.register()
class StepMomentum(MomentumSchedulerMixin, StepParamScheduler):
    """momentum x ``gamma`` every ``step_size`` steps."""


@PARAM_SCHEDULERS.register()
class PolyMomentum(MomentumSchedulerMixin, PolyParamScheduler):
    """Polynomial decay of the momentum to ``eta_min``."""


@PARAM_SCHEDULERS.register()
class CosineRestartMomentum(MomentumSchedulerMixin, CosineRestartParamScheduler):
    """Cosine annealing of the momentum with restarts."""


@PARAM_SCHEDULERS.register()
class ReduceOnPlateauMomentum(MomentumSchedulerMixin, ReduceOnPlateauParamScheduler):
    """momentum x ``factor`` when ``monitor`` stops improving."""
