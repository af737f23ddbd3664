"""Parameter schedulers with MMEngine 0.10's names, arguments and values, to the step.

memfit has its own schedulers rather than torch's: torch's cannot leave a value untouched before
``begin`` and after ``end``, nor spread a change over ``end - begin - 1`` steps as MMEngine does
(``LinearLR(start_factor=0.5, end=5)`` reaches the full lr at epoch 4), so a chain of them written
for MMEngine trains differently. ``base`` holds the core, ``param`` the generic ``*ParamScheduler``
classes, ``lr`` and ``momentum`` MMEngine's named forms, ``plateau`` ReduceOnPlateau, ``build`` the
config builder and ``state`` the checkpoint round trip.
"""

from memfit.optim.scheduler.base import INF, ParamScheduler
from memfit.optim.scheduler.build import build_param_schedulers
from memfit.optim.scheduler.lr import (
    ConstantLR,
    CosineAnnealingLR,
    CosineRestartLR,
    ExponentialLR,
    LinearLR,
    LRSchedulerMixin,
    MultiStepLR,
    OneCycleLR,
    PolyLR,
    ReduceOnPlateauLR,
    StepLR,
)
from memfit.optim.scheduler.momentum import (
    ConstantMomentum,
    CosineAnnealingMomentum,
    CosineRestartMomentum,
    ExponentialMomentum,
    LinearMomentum,
    MomentumSchedulerMixin,
    MultiStepMomentum,
    PolyMomentum,
    ReduceOnPlateauMomentum,
    StepMomentum,
)
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
from memfit.optim.scheduler.state import load_scheduler_state, scheduler_state
from memfit.optim.scheduler.vissl import VisslLR as VisslLR  # VISSL's schedules (registers 'VisslLR')

_ParamScheduler = ParamScheduler  # MMEngine's name

__all__ = [
    "INF", "ParamScheduler", "_ParamScheduler", "build_param_schedulers", "scheduler_state", "load_scheduler_state",
    "LRSchedulerMixin", "MomentumSchedulerMixin",
    "ConstantLR", "CosineAnnealingLR", "CosineRestartLR", "ExponentialLR", "LinearLR", "MultiStepLR", "OneCycleLR",
    "PolyLR", "ReduceOnPlateauLR", "StepLR",
    "ConstantMomentum", "CosineAnnealingMomentum", "CosineRestartMomentum", "ExponentialMomentum", "LinearMomentum",
    "MultiStepMomentum", "PolyMomentum", "ReduceOnPlateauMomentum", "StepMomentum",
    "ConstantParamScheduler", "CosineAnnealingParamScheduler", "CosineRestartParamScheduler",
    "ExponentialParamScheduler", "LinearParamScheduler", "MultiStepParamScheduler", "OneCycleParamScheduler",
    "PolyParamScheduler", "ReduceOnPlateauParamScheduler", "StepParamScheduler",
]
