"""CheckInvalidLossHook: stop at a non-finite (nan/inf) loss naming the iteration, or skip such steps.

mmdet's hook of the same name asserts ``isfinite(loss)`` every ``interval`` iterations. Here the
check never forces a host sync inside the train step: with ``action='stop'`` the losses stay on the
device and are checked together (one sync) every ``interval`` iterations, at each epoch end and
before every checkpoint save, so the error still names the first bad iteration and no checkpoint is
ever written after it. ``action='skip'`` asks the optimizer wrapper to test each loss before its
backward (a sync per micro-step, so it is opt-in) and to skip the optimizer step of any
accumulation window that saw a non-finite loss.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit import dist
from memfit.errors import ConfigError, TrainingError, type_or_value_error
from memfit.hooks.base import Hook
from memfit.registry import HOOKS

ACTIONS = ("stop", "skip")


@HOOKS.register()
class CheckInvalidLossHook(Hook):
    """``default_hooks.check_invalid_loss``: what a nan/inf ``outputs['loss']`` does.

    ``action='stop'`` (default) raises :class:`~memfit.errors.TrainingError` naming the epoch and
    iteration of the first non-finite loss; ``interval`` iterations share one device-to-host sync
    (``interval=1``: one sync per iteration; larger values stop up to ``interval - 1`` iterations
    later, still before any checkpoint is saved). ``action='skip'`` skips the optimizer step of a
    window with a non-finite loss and logs a warning with the running count every ``interval``
    iterations; it runs in one process on one device (ranks would disagree on which step to skip).
    Under several processes the check averages the losses over ranks (one small all-reduce per
    check), so every rank stops at the same iteration.
    Remove the check with ``default_hooks=dict(check_invalid_loss=None)``.
    """

    priority = "ABOVE_NORMAL"  # before the logger and the checkpoint hook

    def __init__(self, interval: int = 10, action: str = "stop") -> None:
        if type(interval) is not int or interval < 1:
            raise type_or_value_error(f"interval={interval!r}: use an int >= 1 (iterations between loss checks)",
                                      type(interval) is not int)
        if action not in ACTIONS:
            raise ConfigError(f"action={action!r}: use 'stop' (raise at a nan/inf loss) or 'skip' (skip that step)")
        self.interval, self.action = interval, action
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # (epoch, iter, loss) not checked yet
        self._reported = 0

    def before_run(self, runner: Any) -> None:
        wrapper = runner.optim_wrapper
        if self.action != "skip" or wrapper is None:
            return
        strategy = type(runner.strategy).__name__
        if not runner.strategy.capabilities.one_device or runner.world_size > 1:
            raise ConfigError(f"check_invalid_loss: action='skip' runs in one process on one device, not {strategy} "
                              f"at world size {runner.world_size}: use action='stop'")
        wrapper.skip_nonfinite = True
        self._reported = getattr(wrapper, "nonfinite_losses", 0)  # a resumed run's count: already reported

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        due = self.every_n_train_iters(runner, self.interval) or self.is_last_train_iter(runner)
        if self.action == "skip":
            if due:
                self._report_skips(runner)
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if isinstance(loss, torch.Tensor):
            self._pending.append((runner.epoch, runner.iter, loss.detach()))
        if due:
            self.check(runner)

    def after_train_epoch(self, runner: Any) -> None:
        self.check(runner)

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        self.check(runner)

    def check(self, runner: Any) -> None:
        """Raise TrainingError if a loss since the last check was nan or inf (one host sync)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # Averaged over ranks (a nan or inf anywhere stays one), so that every rank stops at the same
        # check instead of the others waiting in the next collective for the one that stopped.
        losses = dist.all_reduce_mean(torch.stack([loss.float().sum() for _, _, loss in pending]))
        bad = ~torch.isfinite(losses)
        if not bool(bad.any()):
            return
        first = int(bad.nonzero()[0])
        epoch, it, _ = pending[first]
        where = f"epoch {epoch + 1}, iteration {it + 1}" if runner.train_loop_by_epoch else f"iteration {it + 1}"
        raise TrainingError(
            f"the loss is {float(losses[first])} at {where}: lower the learning rate, clip gradients "
            "(optim_wrapper.clip_grad=dict(max_norm=1.0)) or check the data; "
            "default_hooks.check_invalid_loss.action='skip' skips such steps instead"
        )

    def _report_skips(self, runner: Any) -> None:
        count = getattr(runner.optim_wrapper, "nonfinite_losses", 0)
        if count > self._reported:
            self._reported = count
            runner.logger.warning(f"non-finite loss by iteration {runner.iter + 1}: the optimizer step of its "
                                  f"window was skipped ({count} non-finite losses so far)")
