"""The Hook base class: MMEngine's hook points, called by the runner and loops."""

from __future__ import annotations

from typing import Any

PRIORITIES = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}


def get_priority(priority: int | str) -> int:
    """Priority as an int (lower runs first); accepts MMEngine's names."""
    if isinstance(priority, int):
        return priority
    if priority.upper() in PRIORITIES:
        return PRIORITIES[priority.upper()]
    raise ValueError(f"unknown hook priority {priority!r}: use an int or one of {', '.join(PRIORITIES)}")


class Hook:
    """Base class for hooks. Override any of the methods below; all default to doing nothing.

    ``runner.iter`` inside ``after_train_iter`` is the 0-based global index of the iteration just
    run; ``outputs`` holds the parsed (detached) loss tensors.
    """

    priority: int | str = "NORMAL"

    def before_run(self, runner: Any) -> None: ...
    def after_run(self, runner: Any) -> None: ...
    def before_train(self, runner: Any) -> None: ...
    def after_train(self, runner: Any) -> None: ...
    def before_val(self, runner: Any) -> None: ...
    def after_val(self, runner: Any) -> None: ...
    def before_test(self, runner: Any) -> None: ...
    def after_test(self, runner: Any) -> None: ...
    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None: ...
    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None: ...
    def before_train_epoch(self, runner: Any) -> None: ...
    def after_train_epoch(self, runner: Any) -> None: ...
    def before_val_epoch(self, runner: Any) -> None: ...
    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None: ...
    def before_test_epoch(self, runner: Any) -> None: ...
    def after_test_epoch(self, runner: Any, metrics: dict | None = None) -> None: ...
    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None: ...
    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: dict | None = None
    ) -> None: ...
    def before_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None: ...
    def after_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None: ...
    def before_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None: ...
    def after_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None: ...

    # Helpers with MMEngine's names, for hooks that act every N iterations/epochs.
    def every_n_train_iters(self, runner: Any, n: int) -> bool:
        return n > 0 and (runner.iter + 1) % n == 0

    def every_n_inner_iters(self, batch_idx: int, n: int) -> bool:
        return n > 0 and (batch_idx + 1) % n == 0

    def every_n_epochs(self, runner: Any, n: int) -> bool:
        return n > 0 and (runner.epoch + 1) % n == 0

    def is_last_train_iter(self, runner: Any) -> bool:
        return runner.iter + 1 == runner.max_iters
