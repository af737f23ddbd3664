"""MemoryMonitorHook: the peak memory of logged training iterations, with its breakdown.

``custom_hooks=[dict(type='MemoryMonitorHook')]`` wraps every logged training iteration in a
:class:`memfit.measure.MemoryTracker` and puts ``memory/peak_mb``, ``memory/activations_mb``,
``memory/parameters_mb``, ``memory/gradients_mb``, ``memory/optimizer_state_mb``,
``memory/buffers_mb``, ``memory/communication_mb`` and ``memory/inputs_mb`` (MB = 2**20 bytes) into
the message hub.

Cost: on CUDA the tracker reads the allocator's counters (negligible). On CPU it sees every operator
through a dispatch mode, which slows the measured iterations (a few times on small CPU ops), so
only the iterations the logger prints are measured.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import type_or_value_error
from memfit.hooks.base import Hook
from memfit.measure import CATEGORIES, MB, MemoryTracker
from memfit.registry import HOOKS

DEFAULT_INTERVAL = 10  # the LoggerHook's default, used when no LoggerHook is registered


@HOOKS.register()
class MemoryMonitorHook(Hook):
    """Measure the peak memory of every ``interval``-th training iteration (default: the logger's).

    Runs before other hooks' ``before_train_iter`` and ``after_train_iter`` (priority VERY_HIGH),
    so the measured span is the iteration itself, not the logging or checkpointing after it.
    """

    priority = "VERY_HIGH"

    def __init__(self, interval: int | None = None) -> None:
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise type_or_value_error(
                f"MemoryMonitorHook.interval must be a positive integer or None, got {interval!r}",
                not isinstance(interval, int),
            )
        self.interval = interval
        self._tracker: MemoryTracker | None = None

    def _interval(self, runner: Any) -> int:
        if self.interval is not None:
            return self.interval
        for hook in getattr(runner, "hooks", []):
            if type(hook).__name__ == "LoggerHook" and isinstance(getattr(hook, "interval", None), int):
                return hook.interval
        return DEFAULT_INTERVAL

    def _due(self, runner: Any, batch_idx: int) -> bool:
        loop = getattr(runner, "train_loop", None)
        last = loop is not None and loop.is_last_iter_of_epoch(batch_idx)
        return self.every_n_train_iters(runner, self._interval(runner)) or last

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._close()  # an iteration that raised never reached after_train_iter
        if not self._due(runner, batch_idx):
            return
        wrapper = getattr(runner, "optim_wrapper", None)
        self._tracker = MemoryTracker(runner.model, getattr(wrapper, "optimizer", None))
        self._tracker.__enter__()

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: dict | None = None
    ) -> None:
        tracker = self._close()
        if tracker is None:
            return
        hub = runner.message_hub
        hub.update_scalar("memory/peak_mb", tracker.peak_bytes / MB)
        for category in CATEGORIES:
            hub.update_scalar(f"memory/{category}_mb", tracker.breakdown[category] / MB)

    def after_train(self, runner: Any) -> None:
        self._close()

    def after_run(self, runner: Any) -> None:
        self._close()

    def _close(self) -> MemoryTracker | None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        return tracker
