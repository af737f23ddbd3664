"""IterTimerHook: data loading time and whole-iteration time, for the log line and the ETA."""

from __future__ import annotations

import time
from typing import Any

from memfit.hooks.base import Hook
from memfit.registry import HOOKS


@HOOKS.register()
class IterTimerHook(Hook):
    """Records ``{mode}/data_time`` and ``{mode}/time`` (seconds) into the message hub."""

    priority = "NORMAL"

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._start: float | None = None
        self._iters_timed = 0

    def _begin(self) -> None:
        self._last = time.perf_counter()

    def before_train(self, runner: Any) -> None:
        self._start, self._iters_timed = None, 0

    def before_train_epoch(self, runner: Any) -> None:
        self._begin()

    def before_val_epoch(self, runner: Any) -> None:
        self._begin()

    def before_test_epoch(self, runner: Any) -> None:
        self._begin()

    def _before_iter(self, runner: Any, mode: str) -> None:
        now = time.perf_counter()
        runner.message_hub.update_scalar(f"{mode}/data_time", now - self._last)

    def _after_iter(self, runner: Any, mode: str) -> None:
        now = time.perf_counter()
        runner.message_hub.update_scalar(f"{mode}/time", now - self._last)
        self._last = now

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, "train")

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._after_iter(runner, "train")
        # ETA from the time since the first timed iteration, which excludes start-up costs.
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        else:
            self._iters_timed += 1
        if self._iters_timed:
            per_iter = (now - self._start) / self._iters_timed
        else:
            per_iter = runner.message_hub.latest("train/time")
        runner.message_hub.update_info("eta", per_iter * (runner.max_iters - runner.iter - 1))

    def before_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, "val")

    def after_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._after_iter(runner, "val")

    def before_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, "test")

    def after_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._after_iter(runner, "test")
