"""ParamSchedulerHook: steps each parameter scheduler per iteration or per epoch."""

from __future__ import annotations

from typing import Any

from memfit.hooks.base import Hook
from memfit.registry import HOOKS


@HOOKS.register()
class ParamSchedulerHook(Hook):
    """Steps iteration-based schedulers after every iteration and epoch-based ones after every epoch."""

    priority = "LOW"

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        for s in runner.param_schedulers:
            if not s.by_epoch:
                s.step_at(runner.iter)

    def after_train_epoch(self, runner: Any) -> None:
        for s in runner.param_schedulers:
            if s.by_epoch:
                s.step_at(runner.epoch)
