"""CheckpointHook: periodic, last and best checkpoints, keeping at most ``max_keep_ckpts``."""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path
from typing import Any

from memfit import dist
from memfit.errors import ConfigError
from memfit.hooks.base import Hook
from memfit.registry import HOOKS


@HOOKS.register()
class CheckpointHook(Hook):
    """Save ``epoch_N.pth`` every ``interval`` epochs (or ``iter_N.pth`` every ``interval`` iterations).

    ``save_best='accuracy/top1'`` (or 'auto': the first metric; a prefix such as 'accuracy' matches
    'accuracy/top1') keeps ``best_<metric>_<epoch|iter>_N.pth`` with ``rule`` 'greater' or 'less'
    (default: 'less' for keys containing 'loss', else 'greater'). ``save_last`` also saves at the
    end of training. Every save updates ``last_checkpoint`` for ``resume=True``. ``max_keep_ckpts=K``
    keeps the K newest periodic checkpoints in the work dir (also those of an earlier, resumed run),
    never the best one nor the one ``last_checkpoint`` names. ``save_optimizer=False`` /
    ``save_param_scheduler=False`` write smaller checkpoints that resume with a fresh optimizer /
    fresh schedulers (with a warning).
    """

    priority = "VERY_LOW"

    def __init__(self, interval: int = -1, by_epoch: bool = True, max_keep_ckpts: int = -1,
                 save_last: bool = True, save_best: str | None = None, rule: str | None = None,
                 save_begin: int = 0, save_optimizer: bool = True, save_param_scheduler: bool = True,
                 out_dir: str | None = None) -> None:
        if type(interval) is not int or interval == 0:
            raise ConfigError(f"interval={interval!r}: use an int >= 1, or -1 to save only the last checkpoint")
        if rule not in (None, "greater", "less"):
            raise ConfigError(f"default_hooks.checkpoint.rule={rule!r}: use 'greater' or 'less'")
        if out_dir is not None:
            raise ConfigError("default_hooks.checkpoint.out_dir: checkpoints are written to work_dir; remove out_dir")
        if isinstance(save_best, list | tuple):
            raise ConfigError(f"default_hooks.checkpoint.save_best={save_best!r}: give one metric name (a string)")
        self.interval, self.by_epoch, self.max_keep = interval, by_epoch, max_keep_ckpts
        self.save_last, self.save_best, self.rule, self.save_begin = save_last, save_best, rule, save_begin
        self.save_optimizer, self.save_param_scheduler = save_optimizer, save_param_scheduler

    def before_train(self, runner: Any) -> None:
        if self.by_epoch and not runner.train_loop.by_epoch:
            self.by_epoch = False  # an iteration-based run has no epoch ends to save at
        if dist.is_main_process():
            _remove_stale_temp_files(runner)

    def after_train_epoch(self, runner: Any) -> None:
        if not self.by_epoch:
            return
        n = runner.epoch + 1
        if (n >= self.save_begin and self.every_n_epochs(runner, self.interval)) or (
            self.save_last and n == runner.max_epochs
        ):
            self._save(runner, f"epoch_{n}.pth")

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        if self.by_epoch:
            return
        n = runner.iter + 1
        if (n >= self.save_begin and self.every_n_train_iters(runner, self.interval)) or (
            self.save_last and n == runner.max_iters
        ):
            self._save(runner, f"iter_{n}.pth")

    def _save(self, runner: Any, name: str) -> None:
        runner.save_checkpoint(name, save_optimizer=self.save_optimizer,
                               save_param_scheduler=self.save_param_scheduler)
        if self.max_keep > 0 and dist.is_main_process():
            from memfit.checkpoint import remove_old

            best = runner.message_hub.get_info("best_ckpt")
            protect = [runner.work_dir / best] if best else []
            for path in remove_old(runner.work_dir, self.max_keep, protect=protect):
                runner.logger.debug(f"max_keep_ckpts={self.max_keep}: removed {path.name}")

    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        if not self.save_best or not metrics or runner.train_loop is None:
            return
        key = self._metric_key(metrics)
        rule = self.rule or ("less" if "loss" in key else "greater")
        score = float(metrics[key])
        hub = runner.message_hub
        best = hub.get_info("best_score", -math.inf if rule == "greater" else math.inf)
        if not (score > best if rule == "greater" else score < best):
            return
        unit, n = ("epoch", runner.epoch) if runner.train_loop.by_epoch else ("iter", runner.iter)
        name = f"best_{key.replace('/', '_')}_{unit}_{n}.pth"
        previous = hub.get_info("best_ckpt")
        # Recorded before the save so that the checkpoint itself holds the new best (a run resumed
        # from it must not save the same best again).
        hub.update_info("best_score", score)
        hub.update_info("best_ckpt", name)
        runner.save_checkpoint(name, save_optimizer=self.save_optimizer,
                               save_param_scheduler=self.save_param_scheduler)
        if previous and previous != name and dist.is_main_process():
            _remove(runner.work_dir / previous)
        runner.logger.info(f"New best {key}: {score:.4f}, saved {name}")

    def _metric_key(self, metrics: dict) -> str:
        if self.save_best == "auto":
            return next(iter(metrics))
        if self.save_best in metrics:
            return self.save_best
        prefixed = [k for k in metrics if k.startswith(f"{self.save_best}/")]
        if prefixed:
            return prefixed[0]
        raise ConfigError(f"default_hooks.checkpoint.save_best={self.save_best!r} is not a metric; "
                          f"metrics are: {', '.join(metrics)}")


def _remove(path: Path) -> None:
    """Delete a checkpoint file or sharded checkpoint directory, if it is there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_temp_files(runner: Any) -> None:
    """Delete the temporary files and directories of saves that a kill interrupted (they can be as
    large as a checkpoint), or put back a checkpoint a kill left set aside. Safe at the start of
    training: no save of this run is in flight yet."""
    from memfit.checkpoint.directory import TEMP_PATTERN, recover

    with contextlib.suppress(OSError):
        for path, action in recover(runner.work_dir):
            what = f"{path.name} as {TEMP_PATTERN.match(path.name)['name']}" if action == "restored" else path.name
            runner.logger.warning(f"{action} {what}: left by a save that was interrupted")


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
            hub.update_info("lr", runner.optim_wrapper.get_lr()["lr"][0])
