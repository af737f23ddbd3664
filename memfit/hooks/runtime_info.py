"""RuntimeInfoHook: the run's position and learning rates in the message hub, for the other hooks and the log."""

from __future__ import annotations

from typing import Any

from memfit.hooks.base import Hook
from memfit.registry import HOOKS


@HOOKS.register()
class RuntimeInfoHook(Hook):
    """Puts epoch, iteration and learning rate into the message hub's runtime info."""

    priority = "VERY_HIGH"

    def before_train(self, runner: Any) -> None:
        runner.message_hub.update_info("max_iters", runner.max_iters)
        runner.message_hub.update_info("max_epochs", runner.max_epochs)

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        hub = runner.message_hub
        hub.update_info("epoch", runner.epoch)
        hub.update_info("iter", runner.iter)
        if runner.optim_wrapper is not None:
            for name, values in runner.optim_wrapper.get_lr().items():  # lr, base_lr, <optimizer>.lr
                hub.update_info(name, values[0])
