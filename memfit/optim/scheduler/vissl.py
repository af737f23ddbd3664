"""``VisslLR``: VISSL's learning-rate schedule (``OPTIMIZER.param_schedulers.lr``) as a memfit scheduler.

VISSL's schedules are ClassyVision's: a value is a function of ``where``, the fraction of training
done, not MMEngine's chain of ``[begin, end)`` shapes. This scheduler takes VISSL's dict as it is
(``name``, its values, ``update_interval``, ``num_epochs``) and, at each step, sets every group's lr
to ``schedule(where)`` with ``where = steps done / steps in [begin, end)``: iterations with
``update_interval: step`` (``by_epoch=False``), epochs with ``epoch``. That is VISSL's ``where``
(``iteration / max_iteration``, read once per epoch for ``epoch``), so the lr of every step equals
VISSL's. The formulas are in :mod:`memfit.config.vissl.schedules`.

A group's lr keeps its ratio to the optimizer's lr (``paramwise_cfg`` ``lr_mult``); with no
multipliers every group gets the schedule's value, as in VISSL.

    param_scheduler = dict(type='VisslLR', by_epoch=False, name='composite', update_interval='step',
                           schedulers=[dict(name='linear', start_value=0.01, end_value=0.1),
                                       dict(name='cosine', start_value=0.1, end_value=0.0)],
                           lengths=[0.1, 0.9], interval_scaling=['rescaled', 'fixed'])
"""

from __future__ import annotations

from typing import Any

from memfit.config.vissl.schedules import check_schedule, schedule_value
from memfit.errors import ConfigError
from memfit.optim.scheduler.base import INF, ParamScheduler, optimizer_defaults
from memfit.registry import PARAM_SCHEDULERS


@PARAM_SCHEDULERS.register()
class VisslLR(ParamScheduler):
    """The lr of VISSL's schedule ``name`` at ``where`` (see the module docstring).

    ``update_interval`` ('step' or 'epoch') must agree with ``by_epoch`` (None: follows it). ``num_epochs``
    is the epoch count of multistep/step milestones (default: the schedule's length when by epoch).
    ``auto_lr_scaling`` is accepted off only: a VISSL YAML applies it when it is read (the global batch
    comes from its DISTRIBUTED and DATA keys); write scaled values in a Python config.
    """

    def __init__(self, optimizer: Any, name: str, update_interval: str | None = None, num_epochs: int | None = None,
                 values: list | None = None, milestones: list | None = None, schedulers: list | None = None,
                 lengths: list | None = None, interval_scaling: list | None = None, start_value: float | None = None,
                 end_value: float | None = None, value: float | None = None, base_value: float | None = None,
                 num_decays: int | None = None, gamma: float | None = None, power: float | None = None,
                 auto_lr_scaling: dict | None = None, begin: int = 0, end: int = INF, last_step: int = -1,
                 by_epoch: bool = True, verbose: bool = False) -> None:
        key = "param_scheduler"
        if auto_lr_scaling and auto_lr_scaling.get("auto_scale"):
            raise ConfigError(f"{key}.auto_lr_scaling.auto_scale=True: VisslLR takes the scaled values; a VISSL YAML "
                              "scales them when read, in a Python config write them scaled")
        if update_interval not in (None, "step", "epoch"):
            raise ConfigError(f"{key}.update_interval={update_interval!r}: use 'step' or 'epoch'")
        if update_interval is not None and (update_interval == "epoch") != bool(by_epoch):
            raise ConfigError(f"{key}: update_interval={update_interval!r} needs by_epoch="
                              f"{update_interval == 'epoch'}, got by_epoch={by_epoch}")
        if end == INF:
            raise ConfigError(f"{key}: VisslLR needs the run's length: set end (or train_cfg's max_epochs/max_iters)")
        if num_epochs is None and by_epoch:
            num_epochs = end - begin
        given = dict(name=name, values=values, milestones=milestones, schedulers=schedulers, lengths=lengths,
                     interval_scaling=interval_scaling, start_value=start_value, end_value=end_value, value=value,
                     base_value=base_value, num_decays=num_decays, gamma=gamma, power=power, num_epochs=num_epochs)
        self.schedule = check_schedule({k: v for k, v in given.items() if v is not None}, key, num_epochs)
        self.total = end - begin
        lr = optimizer_defaults(optimizer).get("lr") or 0.0
        self.ratios = [group["lr"] / lr if lr else 1.0 for group in optimizer.param_groups]
        super().__init__(optimizer, "lr", begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step >= self.total:  # after the last step: the value would never be used
            return self._current()
        value = schedule_value(self.schedule, self.last_step / self.total)
        return [value * ratio for ratio in self.ratios]
