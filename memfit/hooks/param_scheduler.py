"""ParamSchedulerHook: steps the parameter schedulers (MMEngine's hook, point for point)."""

from __future__ import annotations

from typing import Any

from memfit.hooks.base import Hook
from memfit.optim.scheduler import ParamScheduler
from memfit.registry import HOOKS


def _groups(runner: Any) -> list[list]:
    """``runner.param_schedulers`` as a list of lists: one list, or one per optimizer (a dict)."""
    schedulers = runner.param_schedulers
    if isinstance(schedulers, list):
        return [schedulers]
    if isinstance(schedulers, dict):
        return list(schedulers.values())
    raise TypeError("runner.param_schedulers should be list of ParamScheduler or a dict containing list of "
                    f"ParamScheduler, but got {schedulers}")


@HOOKS.register()
class ParamSchedulerHook(Hook):
    """Steps iteration-based schedulers after every training iteration, epoch-based ones after every
    training epoch, and ReduceOnPlateau ones (``need_val_args``) with the metrics of every validation.
    A scheduler is any object with ``step()`` and ``by_epoch``."""

    priority = "LOW"

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._step(runner, by_epoch=False)

    def after_train_epoch(self, runner: Any) -> None:
        self._step(runner, by_epoch=True)

    def _step(self, runner: Any, by_epoch: bool) -> None:
        if runner.param_schedulers is None:
            return
        for schedulers in _groups(runner):
            if not isinstance(schedulers, list):
                raise TypeError(f"each value of runner.param_schedulers should be a list, got {schedulers}")
            for scheduler in schedulers:
                if bool(scheduler.by_epoch) == by_epoch:
                    scheduler.step()

    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        if runner.param_schedulers is None or metrics is None:  # the epoch was counted in after_train_epoch
            return
        for schedulers in _groups(runner):
            if not (isinstance(schedulers, list) and all(isinstance(s, ParamScheduler) for s in schedulers)):
                continue  # MMEngine steps only a list of built ParamSchedulers
            for scheduler in schedulers:
                if scheduler.by_epoch and getattr(scheduler, "need_val_args", False):
                    scheduler.step(metrics)
