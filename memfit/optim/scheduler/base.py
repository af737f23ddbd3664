"""``ParamScheduler``: MMEngine's ``_ParamScheduler`` core, for any optimizer hyper-parameter.

A scheduler owns one key of ``optimizer.param_groups`` (``lr``, ``momentum``, ``weight_decay``, ...).
It is stepped once per epoch or per iteration and counts those calls in ``_global_step``; only the
steps inside ``[begin, end)`` change the value (``last_step`` counts them), so before ``begin`` and
from ``end`` on the value is whatever the groups hold. Values are computed in MMEngine's *chained*
form, from the group's current value, so several schedulers on one key compose step by step as
they do in MMEngine (the order in the config is the order they apply).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from memfit.logger import LOGGER_NAME

INF = int(1e9)  # MMEngine's "no end"


def optimizer_defaults(optimizer: Any) -> dict:
    """The optimizer's ``defaults`` through a wrapper (memfit's OptimWrapper holds ``.optimizer``)."""
    defaults = getattr(optimizer, "defaults", None)
    return defaults if defaults is not None else optimizer.optimizer.defaults


def check_optimizer(optimizer: Any) -> None:
    """MMEngine accepts an Optimizer or an OptimWrapper; memfit anything with ``param_groups``."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"``optimizer`` should be an Optimizer or an OptimWrapper (anything with param_groups), "
                        f"but got {type(optimizer).__name__}")


def init_initial_values(optimizer: Any, param_name: str, last_step: int) -> None:
    """Record ``initial_<name>`` in every group (MMEngine's rule: a fresh scheduler keeps an existing
    record, one resumed by ``last_step`` needs it)."""
    if not (isinstance(last_step, int) and last_step >= -1):
        raise ValueError(f"last_step should be an int >= -1, got {last_step!r}")
    for i, group in enumerate(optimizer.param_groups):
        if last_step == -1:
            group.setdefault(f"initial_{param_name}", group[param_name])
        elif f"initial_{param_name}" not in group:
            raise KeyError(f"param 'initial_{param_name}' is not specified in param_groups[{i}] "
                           "when resuming an optimizer")


class ParamScheduler:
    """Schedules ``param_name`` of every param group inside ``[begin, end)``.

    Subclasses implement ``_get_value()`` (the values of step ``last_step`` from the groups' current
    ones) and list in ``_epoch_args`` the arguments counted in epochs, which
    ``build_iter_from_epoch`` multiplies by the epoch length. Construction applies step 0.
    """

    _epoch_args: tuple[str, ...] = ()

    def __init__(self, optimizer: Any, param_name: str, begin: int = 0, end: int = INF, last_step: int = -1,
                 by_epoch: bool = True, verbose: bool = False) -> None:
        check_optimizer(optimizer)
        if end <= begin:
            raise ValueError(f"end should be larger than begin, but got begin={begin}, end={end}")
        self.optimizer, self.param_name = optimizer, param_name
        self.begin, self.end, self.by_epoch, self.verbose = begin, end, by_epoch, verbose
        init_initial_values(optimizer, param_name, last_step)
        self.base_values = [group[f"initial_{param_name}"] for group in optimizer.param_groups]
        self.last_step = last_step
        self._global_step = -1
        self.step()

    @classmethod
    def build_iter_from_epoch(cls, *args: Any, begin: int = 0, end: int = INF, by_epoch: bool = True,
                              epoch_length: int | None = None, **kwargs: Any) -> ParamScheduler:
        """An iteration-based instance of an epoch-based config (``convert_to_iter_based=True``):
        ``begin``, ``end`` and the arguments in ``_epoch_args`` are multiplied by ``epoch_length``."""
        if not by_epoch:
            raise ValueError("only an epoch-based scheduler (by_epoch=True) can be converted to iteration-based")
        if not (isinstance(epoch_length, int) and epoch_length > 0):
            raise ValueError(f"`epoch_length` must be a positive integer, but got {epoch_length}")
        for name in cls._epoch_args:
            value = kwargs.get(name)
            if isinstance(value, (list, tuple)):
                kwargs[name] = [v * epoch_length for v in value]
            elif value is not None:
                kwargs[name] = value * epoch_length
        end = end if end == INF else int(end * epoch_length)
        return cls(*args, begin=int(begin * epoch_length), end=end, by_epoch=False, **kwargs)

    def _get_value(self) -> list:
        raise NotImplementedError

    def _current(self) -> list:
        return [group[self.param_name] for group in self.optimizer.param_groups]

    def step(self) -> None:
        """One epoch or iteration passed: set the value of the next one (when inside ``[begin, end)``)."""
        self._global_step += 1
        if self.begin <= self._global_step < self.end:
            self.last_step += 1
            self._apply(self._get_value())
        self._last_value = self._current()

    def _apply(self, values: list) -> None:
        for i, (group, value) in enumerate(zip(self.optimizer.param_groups, values)):
            group[self.param_name] = value
            self.print_value(self.verbose, i, value)

    def print_value(self, is_verbose: bool, group: int, value: float) -> None:
        if is_verbose:
            logging.getLogger(LOGGER_NAME).info(f"Adjusting parameter value of group {group} to {value:.4e}.")

    def get_last_value(self) -> list:
        """The values the last ``step()`` left in the groups."""
        return self._last_value

    def state_dict(self) -> dict:
        """Everything but the optimizer (MMEngine's rule); plain ints, floats, strings, lists and dicts
        only, so a checkpoint loads with ``weights_only=True``."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update(state_dict)

    def __repr__(self) -> str:
        unit = "epoch" if self.by_epoch else "iter"
        return f"{type(self).__name__}({self.param_name}, [{self.begin}, {self.end}) by {unit}, step {self.last_step})"


def fixed_param_signature(cls: type) -> inspect.Signature | None:
    """The signature of ``cls``'s scheduler class without ``param_name``, for a class whose mixin
    fixes it (``LinearLR`` = ``LinearParamScheduler`` with ``param_name='lr'``), so that config keys
    are checked against the real arguments. ``None`` (inspect reads ``__init__``) when ``cls``
    defines its own ``__init__``."""
    if "__init__" in vars(cls):
        return None
    base = next(k for k in cls.__mro__[1:] if issubclass(k, ParamScheduler) and "__init__" in vars(k))
    sig = inspect.signature(base)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "param_name"])
