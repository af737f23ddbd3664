"""``ReduceOnPlateauParamScheduler``: multiply by ``factor`` when a validation metric stops improving.

MMEngine's rules: ``step()`` without metrics (after every training epoch) only counts epochs;
``step(metrics)`` (the ParamSchedulerHook calls it after every validation) compares
``metrics[monitor]`` with the best so far, inside ``[begin, end)`` counted in training epochs.
``by_epoch=True`` only, as in MMEngine; in an iteration-based run it is stepped the same way, with
the metrics of every validation (``patience`` counts validations), and its epoch count stays 0 until
the run's single epoch-end.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.optim.scheduler.base import INF, ParamScheduler, check_optimizer, init_initial_values
from memfit.registry import PARAM_SCHEDULERS


@PARAM_SCHEDULERS.register()
class ReduceOnPlateauParamScheduler(ParamScheduler):
    """``rule='less'|'greater'``: the direction of improvement; ``threshold_rule='rel'|'abs'``: how much
    counts as one; after more than ``patience`` epochs without it the value is multiplied by ``factor``
    (not below ``min_value``, not by less than ``eps``), then ``cooldown`` epochs are ignored."""

    need_val_args = True

    def __init__(self, optimizer: Any, param_name: str, monitor: str = "loss", rule: str = "less",
                 factor: float = 0.1, patience: int = 10, threshold: float = 1e-4, threshold_rule: str = "rel",
                 cooldown: int = 0, min_value: float | list = 0.0, eps: float = 1e-8, begin: int = 0,
                 end: int = INF, last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        check_optimizer(optimizer)
        if end <= begin:
            raise ConfigError(f"end should be larger than begin, but got begin={begin}, end={end}")
        if not by_epoch:
            raise ConfigError(f"by_epoch=False: {type(self).__name__} only supports by_epoch=True (as MMEngine's); "
                              "it is stepped with every validation's metrics in an iteration-based run too: "
                              "drop by_epoch=False")
        if factor >= 1.0:
            raise ConfigError("Factor should be < 1.0.")
        if threshold < 0:
            raise ConfigError(f"threshold {threshold} should be >= 0.")
        if rule not in ("less", "greater"):
            raise ConfigError(f"mode {rule} is unknown!")
        if threshold_rule not in ("rel", "abs"):
            raise ConfigError(f"threshold mode {threshold_rule} is unknown!")
        self.optimizer, self.param_name = optimizer, param_name
        self.begin, self.end, self.by_epoch, self.verbose = begin, end, by_epoch, verbose
        init_initial_values(optimizer, param_name, last_step)
        self.last_step, self._global_step = last_step, 0
        groups = optimizer.param_groups
        if isinstance(min_value, (list, tuple)):
            # One per optimizer group; a wrapper's extra ``base_param_settings`` group takes the last one.
            raw = getattr(optimizer, "optimizer", optimizer).param_groups
            if len(min_value) != len(raw):
                raise ConfigError(f"expected {len(raw)} min_lrs, got {len(min_value)}")
            self.min_values = list(min_value) + [min_value[-1]] * (len(groups) - len(raw))
        else:
            self.min_values = [min_value] * len(groups)
        self.factor, self.patience, self.cooldown, self.eps, self.monitor = factor, patience, cooldown, eps, monitor
        self.rule, self.threshold, self.threshold_rule = rule, threshold, threshold_rule
        self.rule_worse = INF if rule == "less" else -INF
        self.best, self.num_bad_epochs, self.cooldown_counter = self.rule_worse, 0, 0
        self._last_value = self._current()

    def step(self, metrics: dict | None = None) -> None:
        """Without ``metrics``: one training epoch passed. With them: judge ``metrics[monitor]``."""
        if metrics is None:
            self._global_step += 1
            return
        if not isinstance(metrics, dict):
            raise TypeError(f"metrics type should be dict, but got type {type(metrics)}")
        if self.begin <= self._global_step < self.end:
            self.last_step += 1
            if self.monitor not in metrics:
                raise KeyError(f"Excepted key in {list(metrics.keys())}, but got key {self.monitor} is not in dict")
            metric = float(metrics[self.monitor])  # a 0-dim tensor too; a float keeps the state plain
            if self._is_better(metric, self.best):
                self.best, self.num_bad_epochs = metric, 0
            else:
                self.num_bad_epochs += 1
            if self.cooldown_counter > 0:
                self.cooldown_counter -= 1
                self.num_bad_epochs = 0  # bad epochs in cooldown do not count
            if self.num_bad_epochs > self.patience:
                for i, (group, value) in enumerate(zip(self.optimizer.param_groups, self._get_value())):
                    if group[self.param_name] - value > self.eps:
                        group[self.param_name] = value
                        self.print_value(self.verbose, i, value)
                self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_value = self._current()

    def _get_value(self) -> list:
        return [max(float(v) * self.factor, low) for v, low in zip(self._current(), self.min_values)]

    def _is_better(self, a: float, best: float) -> bool:
        if self.rule == "less":
            return a < best * (1.0 - self.threshold) if self.threshold_rule == "rel" else a < best - self.threshold
        return a > best * (self.threshold + 1.0) if self.threshold_rule == "rel" else a > best + self.threshold
