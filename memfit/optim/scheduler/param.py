"""MMEngine's generic ``*ParamScheduler`` classes: any ``param_name`` (``weight_decay``, ``lr``, ...).

Each ``_get_value`` is MMEngine 0.10's chained formula, written in the same order of operations so
the floats match. Changes spread over ``end - begin - 1`` steps (``total_iters``): the value of the
last step inside ``[begin, end)`` is already the final one.
"""

from __future__ import annotations

import math
from typing import Any

from memfit.errors import ConfigError, type_or_value_error
from memfit.optim.scheduler.base import INF, ParamScheduler
from memfit.registry import PARAM_SCHEDULERS


@PARAM_SCHEDULERS.register()
class StepParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` every ``step_size`` steps."""

    _epoch_args = ("step_size",)

    def __init__(self, optimizer: Any, param_name: str, step_size: int, gamma: float = 0.1, begin: int = 0,
                 end: int = INF, last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        # MMEngine builds any step_size and fails at the first step (modulo by zero, or by a str): refused here.
        if isinstance(step_size, bool) or not isinstance(step_size, int | float) or step_size <= 0:
            raise type_or_value_error(f"step_size={step_size!r}: use a positive number of "
                                      f"{'epochs' if by_epoch else 'iterations'} between two multiplications by gamma",
                                      not isinstance(step_size, int | float))
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step == 0 or self.last_step % self.step_size != 0:
            return self._current()
        return [v * self.gamma for v in self._current()]


@PARAM_SCHEDULERS.register()
class MultiStepParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` at each of ``milestones`` (a repeated milestone multiplies again)."""

    _epoch_args = ("milestones",)

    def __init__(self, optimizer: Any, param_name: str, milestones: list[int], gamma: float = 0.1,
                 last_step: int = -1, begin: int = 0, end: int = INF, by_epoch: bool = True,
                 verbose: bool = False) -> None:
        self.milestones: dict[int, int] = {}  # MMEngine's Counter, as a plain dict for weights_only loading
        for m in milestones:
            self.milestones[m] = self.milestones.get(m, 0) + 1
        self.gamma = gamma
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step not in self.milestones:
            return self._current()
        return [v * self.gamma ** self.milestones[self.last_step] for v in self._current()]


@PARAM_SCHEDULERS.register()
class ConstantParamScheduler(ParamScheduler):
    """Multiply by ``factor`` on ``[begin, end - 1)``; restored at step ``end - begin - 1``."""

    def __init__(self, optimizer: Any, param_name: str, factor: float = 1.0 / 3, begin: int = 0, end: int = INF,
                 last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        if factor > 1.0 or factor < 0:
            raise ValueError("Constant multiplicative factor should between 0 and 1.")
        if factor == 0 and end != INF:  # MMEngine divides by it at step end - begin - 1 (ZeroDivisionError)
            raise ConfigError("factor=0: the value is restored at end by dividing by factor: use a factor in (0, 1]")
        self.factor, self.total_iters = factor, end - begin - 1
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step == 0:
            return [v * self.factor for v in self._current()]
        if self.last_step == self.total_iters:
            return [v * (1.0 / self.factor) for v in self._current()]
        return self._current()


@PARAM_SCHEDULERS.register()
class ExponentialParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` every step after the first."""

    def __init__(self, optimizer: Any, param_name: str, gamma: float, begin: int = 0, end: int = INF,
                 last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        self.gamma = gamma
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step == 0:
            return self._current()
        return [v * self.gamma for v in self._current()]


@PARAM_SCHEDULERS.register()
class CosineAnnealingParamScheduler(ParamScheduler):
    """Cosine from the current value to ``eta_min`` (or ``base * eta_min_ratio``) over ``T_max`` steps
    (default ``end - begin``)."""

    _epoch_args = ("T_max",)

    def __init__(self, optimizer: Any, param_name: str, T_max: int | None = None, eta_min: float | None = None,
                 begin: int = 0, end: int = INF, last_step: int = -1, by_epoch: bool = True, verbose: bool = False,
                 eta_min_ratio: float | None = None) -> None:
        if eta_min is None and eta_min_ratio is None:  # MMEngine: neither given anneals to 0
            eta_min = 0.0
        if eta_min is not None and eta_min_ratio is not None:
            raise ConfigError(f"eta_min={eta_min!r} and eta_min_ratio={eta_min_ratio!r}: either `eta_min` or "
                              "`eta_min_ratio` should be specified, not both: drop one")
        self.T_max, self.eta_min, self.eta_min_ratio = T_max or (end - begin), eta_min, eta_min_ratio
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _eta_min(self, base: float) -> float:
        return self.eta_min if self.eta_min_ratio is None else base * self.eta_min_ratio

    def _get_value(self) -> list:
        t, T = self.last_step, self.T_max
        if t == 0:
            return self._current()
        pairs = zip(self.base_values, self._current())
        if (t - 1 - T) % (2 * T) == 0:
            return [v + (b - self._eta_min(b)) * (1 - math.cos(math.pi / T)) / 2 for b, v in pairs]
        return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (v - self._eta_min(b))
                + self._eta_min(b) for b, v in pairs]


@PARAM_SCHEDULERS.register()
class LinearParamScheduler(ParamScheduler):
    """Factor from ``start_factor`` to ``end_factor`` linearly over ``end - begin - 1`` steps.

    ``start_factor=0``: MMEngine's chained form divides by zero at the second step; memfit then uses
    the closed form ``base * factor(t)``, the values MMEngine's formula describes.
    """

    def __init__(self, optimizer: Any, param_name: str, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 begin: int = 0, end: int = INF, last_step: int = -1, by_epoch: bool = True,
                 verbose: bool = False) -> None:
        if start_factor > 1.0 or start_factor < 0:
            raise ValueError("Starting multiplicative factor should between 0 and 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError("Ending multiplicative factor should between 0 and 1.")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, end - begin - 1
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        s, e, t = self.start_factor, self.end_factor, self.last_step
        if t == 0:
            return [v * s for v in self._current()]
        previous = self.total_iters * s + (t - 1) * (e - s)  # total_iters * factor(t - 1)
        if previous == 0:
            return [b * (s + (e - s) * min(t, self.total_iters) / self.total_iters) for b in self.base_values]
        return [v * (1.0 + (e - s) / previous) for v in self._current()]


@PARAM_SCHEDULERS.register()
class PolyParamScheduler(ParamScheduler):
    """Polynomial decay to ``eta_min`` with ``power`` over ``end - begin - 1`` steps."""

    def __init__(self, optimizer: Any, param_name: str, eta_min: float = 0, power: float = 1.0, begin: int = 0,
                 end: int = INF, last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        self.eta_min, self.power, self.total_iters = eta_min, power, end - begin - 1
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        if self.last_step == 0:
            return self._current()
        keep = (1 - 1 / (self.total_iters - self.last_step + 1)) ** self.power
        return [(v - self.eta_min) * keep + self.eta_min for v in self._current()]


def _annealing_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _annealing_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


@PARAM_SCHEDULERS.register()
class OneCycleParamScheduler(ParamScheduler):
    """The 1cycle policy: ``eta_max / div_factor`` up to ``eta_max`` (``pct_start`` of ``total_steps``),
    then down to ``initial / final_div_factor`` (``three_phase``: back to initial first). Not chainable."""

    _epoch_args = ("total_steps",)

    def __init__(self, optimizer: Any, param_name: str, eta_max: float | list = 0, total_steps: int | None = None,
                 pct_start: float = 0.3, anneal_strategy: str = "cos", div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, begin: int = 0, end: int = INF,
                 last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        if param_name != "lr":
            raise ValueError(f"OneCycle only works for the learning rate, got param_name {param_name!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps <= 0):
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f'anneal_strategy must by one of "cos" or "linear", instead got {anneal_strategy}')
        self.eta_max, self.div_factor, self.final_div_factor = eta_max, div_factor, final_div_factor
        self.total_steps = total_steps if total_steps is not None else end - begin
        self.anneal_strategy = anneal_strategy
        phases = [(float(pct_start * self.total_steps) - 1, "initial", "max")]
        if three_phase:
            phases.append((float(2 * pct_start * self.total_steps) - 2, "max", "initial"))
            phases.append((self.total_steps - 1, "initial", "min"))
        else:
            phases.append((self.total_steps - 1, "max", "min"))
        self._schedule_phases = [
            {"end_step": end_step, f"start_{param_name}": f"{a}_{param_name}", f"end_{param_name}": f"{b}_{param_name}"}
            for end_step, a, b in phases
        ]
        groups = optimizer.param_groups
        if isinstance(eta_max, (list, tuple)) and len(eta_max) != len(groups):
            raise ValueError(f"expected {len(groups)} values for max_{param_name}, got {len(eta_max)}")
        max_values = list(eta_max) if isinstance(eta_max, (list, tuple)) else [eta_max] * len(groups)
        if last_step == -1:
            for group, top in zip(groups, max_values):
                group[f"initial_{param_name}"] = top / div_factor
                group[f"max_{param_name}"] = top
                group[f"min_{param_name}"] = group[f"initial_{param_name}"] / final_div_factor
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        step = self.last_step
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step + 1} times. The specified number of total steps is "
                             f"{self.total_steps}")
        anneal = _annealing_cos if self.anneal_strategy == "cos" else _annealing_linear
        values, last = [], len(self._schedule_phases) - 1
        for group in self.optimizer.param_groups:
            start_step = 0
            for i, phase in enumerate(self._schedule_phases):
                end_step = phase["end_step"]
                if step <= end_step or i == last:
                    pct = (step - start_step) / (end_step - start_step)
                    values.append(anneal(group[phase["start_" + self.param_name]],
                                         group[phase["end_" + self.param_name]], pct))
                    break
                start_step = end_step
        return values


@PARAM_SCHEDULERS.register()
class CosineRestartParamScheduler(ParamScheduler):
    """Cosine annealing restarted after each of ``periods``, the peak scaled by ``restart_weights``."""

    _epoch_args = ("periods",)

    def __init__(self, optimizer: Any, param_name: str, periods: list[int], restart_weights: Any = (1,),
                 eta_min: float | None = None, eta_min_ratio: float | None = None, begin: int = 0, end: int = INF,
                 last_step: int = -1, by_epoch: bool = True, verbose: bool = False) -> None:
        if (eta_min is None) == (eta_min_ratio is None):  # MMEngine asserts exactly one (no default here)
            raise ConfigError(f"eta_min={eta_min!r}, eta_min_ratio={eta_min_ratio!r}: exactly one of `eta_min` and "
                              "`eta_min_ratio` should be specified: set one (e.g. eta_min=0)")
        if len(periods) != len(restart_weights):
            raise ValueError("periods and restart_weights should have the same length.")
        self.periods, self.restart_weights = list(periods), list(restart_weights)
        self.eta_min, self.eta_min_ratio = eta_min, eta_min_ratio
        self.cumulative_periods = [sum(self.periods[: i + 1]) for i in range(len(self.periods))]
        super().__init__(optimizer, param_name, begin, end, last_step, by_epoch, verbose)

    def _get_value(self) -> list:
        idx = next((i for i, p in enumerate(self.cumulative_periods) if self.last_step < p), None)
        if idx is None:  # past the last period: leave the values
            return self._current()
        weight, period = self.restart_weights[idx], self.periods[idx]
        step = self.last_step - (0 if idx == 0 else self.cumulative_periods[idx - 1])
        values = []
        for base, v in zip(self.base_values, self._current()):
            eta_min = self.eta_min if self.eta_min_ratio is None else base * self.eta_min_ratio
            if step == 0:
                values.append(base * weight)
            else:
                values.append((1 + math.cos(math.pi * step / period)) / (1 + math.cos(math.pi * (step - 1) / period))
                              * (v - eta_min) + eta_min)
        return values
