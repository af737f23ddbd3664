"""``ParamScheduler``: MMEngine's ``_ParamScheduler`` core, for any optimizer hyper-parameter.

A scheduler owns one key of ``optimizer.param_groups`` (``lr``, ``momentum``, ``weight_decay``, ...).
It is stepped once per epoch or per iteration and counts those calls in ``_global_step``; only the
steps inside ``[begin, end)`` change the value (``last_step`` counts them), so before ``begin`` and
from ``end`` on the value is whatever the groups hold. Values are computed in MMEngine's *chained*
form, from the group's current value, so several schedulers on one key compose step by step as
they do in MMEngine (the order in the config is the order they apply).

As MMEngine (after torch's LRScheduler), a scheduler counts its optimizer's ``step()`` calls and warns
once, at its first ``step()``, when the optimizer has not stepped yet or its ``step`` was replaced.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from typing import Any

from memfit.errors import ConfigError, ConfigTypeError
from memfit.logger import LOGGER_NAME

INF = int(1e9)  # MMEngine's "no end"


def optimizer_defaults(optimizer: Any) -> dict:
    """The optimizer's ``defaults`` through a wrapper (memfit's OptimWrapper holds ``.optimizer``)."""
    defaults = getattr(optimizer, "defaults", None)
    return defaults if defaults is not None else optimizer.optimizer.defaults


def check_optimizer(optimizer: Any) -> None:
    """MMEngine accepts an Optimizer or an OptimWrapper; memfit anything with ``param_groups``."""
    if not hasattr(optimizer, "param_groups"):
        raise ConfigTypeError(f"optimizer: got {type(optimizer).__name__}: pass an Optimizer or an OptimWrapper "
                              "(anything with param_groups)")


def init_initial_values(optimizer: Any, param_name: str, last_step: int) -> None:
    """Record ``initial_<name>`` in every group (MMEngine's rule: a fresh scheduler keeps an existing
    record, one resumed by ``last_step`` needs it)."""
    if not (isinstance(last_step, int) and last_step >= -1):
        raise ConfigError(f"last_step={last_step!r}: use an int >= -1 (-1: a fresh scheduler)")
    for i, group in enumerate(optimizer.param_groups):
        if last_step == -1:
            group.setdefault(f"initial_{param_name}", group[param_name])
        elif f"initial_{param_name}" not in group:
            raise KeyError(f"param 'initial_{param_name}' is not specified in param_groups[{i}] "
                           "when resuming an optimizer")


_OVERRIDDEN = ("Seems like `optimizer.step()` has been overridden after parameter value scheduler initialization. "
               "Please, make sure to call `optimizer.step()` before `scheduler.step()`. See more details at "
               "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate")
_BEFORE = ("Detected call of `scheduler.step()` before `optimizer.step()`. In PyTorch 1.1.0 and later, you should "
           "call them in the opposite order: `optimizer.step()` before `scheduler.step()`. Failure to do this will "
           "result in PyTorch skipping the first value of the parameter value schedule. See more details at "
           "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate")


def count_optimizer_steps(optimizer: Any) -> None:
    """MMEngine's counter: replace ``optimizer.step`` by a wrapper that counts calls in the optimizer's
    ``_global_step`` (reset to -1 here), once per optimizer, so a scheduler can tell whether the
    optimizer stepped before it. An optimizer without a bound ``step`` (a stand-in holding only
    ``param_groups``) is left alone and never warned about."""
    method = getattr(optimizer, "step", None)
    if not getattr(method, "_with_counter", False):
        owner, func = getattr(method, "__self__", None), getattr(method, "__func__", None)
        if owner is None or func is None:
            return
        try:  # a weak reference, as MMEngine's: no cycle optimizer -> step -> optimizer
            ref, cls = weakref.ref(owner), type(owner)
        except TypeError:
            return

        @functools.wraps(func)
        def step(*args: Any, **kwargs: Any) -> Any:
            instance = ref()
            instance._global_step += 1
            return func.__get__(instance, cls)(*args, **kwargs)

        step._with_counter = True  # type: ignore[attr-defined]
        try:
            optimizer.step = step
        except AttributeError:
            return
    optimizer._global_step = -1


def warn_step_order(optimizer: Any) -> None:
    """At a scheduler's first ``step()``: MMEngine's UserWarning when ``optimizer.step`` was replaced
    after the scheduler wrapped it, or when the optimizer has not stepped yet."""
    if not hasattr(optimizer, "_global_step"):  # not counted (see count_optimizer_steps)
        return
    if not getattr(optimizer.step, "_with_counter", False):
        warnings.warn(_OVERRIDDEN, UserWarning, stacklevel=3)
    elif optimizer._global_step < 0:
        warnings.warn(_BEFORE, UserWarning, stacklevel=3)


def check_epoch_length(epoch_length: Any) -> None:
    """``convert_to_iter_based``'s ``epoch_length``: a positive int (iterations per epoch)."""
    if epoch_length is not None and (isinstance(epoch_length, bool) or not isinstance(epoch_length, int)):
        raise ConfigTypeError(f"epoch_length={epoch_length!r}: got {type(epoch_length).__name__}: "
                              "use the number of iterations per epoch (a positive int)")
    if epoch_length is None or epoch_length <= 0:
        raise ConfigError(f"epoch_length={epoch_length!r}: `epoch_length` must be a positive integer "
                          "(the number of iterations per epoch)")


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
            raise ConfigError(f"end should be larger than begin, but got begin={begin}, end={end}")
        self.optimizer, self.param_name = optimizer, param_name
        self.begin, self.end, self.by_epoch, self.verbose = begin, end, by_epoch, verbose
        init_initial_values(optimizer, param_name, last_step)
        self.base_values = [group[f"initial_{param_name}"] for group in optimizer.param_groups]
        self.last_step = last_step
        count_optimizer_steps(optimizer)
        self._global_step = -1
        self.step()

    @classmethod
    def build_iter_from_epoch(cls, *args: Any, begin: int = 0, end: int = INF, by_epoch: bool = True,
                              epoch_length: int | None = None, **kwargs: Any) -> ParamScheduler:
        """An iteration-based instance of an epoch-based config (``convert_to_iter_based=True``):
        ``begin``, ``end`` and the arguments in ``_epoch_args`` are multiplied by ``epoch_length``."""
        if not by_epoch:
            raise ConfigError("by_epoch=False: only an epoch-based scheduler can be converted to iteration-based: "
                              "drop by_epoch=False or convert_to_iter_based=True")
        check_epoch_length(epoch_length)
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
        if self._global_step == 0:  # the first step after construction's
            warn_step_order(self.optimizer)
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
