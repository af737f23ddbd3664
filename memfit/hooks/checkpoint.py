"""CheckpointHook: periodic, last and best checkpoints with MMEngine's arguments, keeping at most
``max_keep_ckpts``; RuntimeInfoHook."""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import operator
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memfit import dist
from memfit.errors import ConfigError, ConfigTypeError, type_or_value_error
from memfit.hooks.base import Hook, _overridden, check_local_storage, check_switches, save_waits
from memfit.hooks.checkpoint_options import _WHERE, rule_list, save_best_list, str_list
from memfit.log_dir import unwritable
from memfit.registry import HOOKS


@HOOKS.register()
class CheckpointHook(Hook):
    """Save ``epoch_N.pth`` every ``interval`` epochs (or ``iter_N.pth`` every ``interval`` iterations).

    MMEngine's arguments and semantics: periodic saves at ``save_begin``, ``save_begin + interval``, ...
    (and the last one with ``save_last``), named by ``filename_tmpl`` (one ``{}``); ``out_dir`` puts them
    in ``out_dir/<work_dir's last folder>`` (``last_checkpoint`` stays in the work dir and names them, so
    ``resume=True`` finds them). ``save_best`` (a metric, a list of metrics, or 'auto': the first one; a
    prefix such as 'accuracy' matches 'accuracy/top1') keeps one ``best_<metric>_<filename>`` per metric,
    compared by ``rule`` ('greater'/'less', one or one per metric; None: decided by ``greater_keys`` /
    ``less_keys``). The message hub holds ``best_score``/``best_ckpt`` (``best_score_<metric>`` ... with
    several metrics). ``published_keys`` writes ``<name>-<sha256[:8]>.pth`` copies of the last and best
    checkpoints holding only those keys after training (a sharded directory gathered into that one
    file). ``max_keep_ckpts=K`` keeps the K newest periodic checkpoints of the run, as MMEngine: their
    numbers are the message hub's ``keep_ckpt_ids``, saved in every checkpoint, so a resumed run goes on
    deleting the ones saved before the resume (and nothing it did not save); never a best one nor the
    one ``last_checkpoint`` names. ``save_optimizer=False`` / ``save_param_scheduler=False`` write
    smaller checkpoints that resume with a fresh optimizer / fresh schedulers (with a warning). Unlike
    MMEngine, a best checkpoint holds the whole training state and becomes the one ``last_checkpoint``
    names, so no periodic checkpoint is saved again to record the new best. Only local disk:
    ``backend_args``/``file_client_args`` warn.
    """

    priority = "VERY_LOW"
    rule_map = {"greater": operator.gt, "less": operator.lt}
    init_value_map = {"greater": -math.inf, "less": math.inf}
    _default_greater_keys = ["acc", "top", "AR@", "auc", "precision", "mAP", "mDice", "mIoU", "mAcc", "aAcc"]
    _default_less_keys = ["loss"]

    def __init__(self, interval: int = -1, by_epoch: bool = True, save_optimizer: bool = True,
                 save_param_scheduler: bool = True, out_dir: str | Path | None = None, max_keep_ckpts: int = -1,
                 save_last: bool = True, save_best: str | list[str] | None = None,
                 rule: str | list[str | None] | None = None, greater_keys: str | Sequence[str] | None = None,
                 less_keys: str | Sequence[str] | None = None, file_client_args: dict | None = None,
                 filename_tmpl: str | None = None, backend_args: dict | None = None,
                 published_keys: str | Sequence[str] | None = None, save_begin: int = 0) -> None:
        # A wrongly typed argument is a TypeError, as MMEngine's (its interval and save_begin fail in a
        # comparison with an int, published_keys by an explicit check); a bad value a ValueError.
        if type(interval) is not int or interval == 0:
            raise type_or_value_error(f"interval={interval!r}: use an int >= 1, or -1 to save only the last "
                                      "checkpoint", type(interval) is not int)
        if type(save_begin) is not int or save_begin < 0:
            raise type_or_value_error(f"{_WHERE}.save_begin={save_begin!r}: use an int >= 0 (the epoch or "
                                      "iteration of the first periodic checkpoint)", type(save_begin) is not int)
        check_switches(_WHERE, by_epoch=by_epoch, save_optimizer=save_optimizer,
                       save_param_scheduler=save_param_scheduler, save_last=save_last)
        if type(max_keep_ckpts) is not int:
            raise ConfigTypeError(f"{_WHERE}.max_keep_ckpts={max_keep_ckpts!r}: use an int (-1 keeps all)")
        if filename_tmpl is not None and (not isinstance(filename_tmpl, str) or filename_tmpl.count("{}") != 1):
            raise type_or_value_error(f"{_WHERE}.filename_tmpl={filename_tmpl!r}: use a str with one '{{}}' for "
                                      "the epoch or iteration, e.g. 'ckpt_{}.pth'", not isinstance(filename_tmpl, str))
        check_local_storage(_WHERE, out_dir, backend_args, file_client_args)
        self.interval, self.by_epoch, self.max_keep_ckpts = interval, by_epoch, max_keep_ckpts
        self.save_last, self.save_begin = save_last, save_begin
        self.save_optimizer, self.save_param_scheduler = save_optimizer, save_param_scheduler
        self.out_dir: Any = out_dir  # a Path once training starts: out_dir/<work_dir name>, or the work dir
        self._out_arg = out_dir
        self._filename_tmpl = filename_tmpl
        self.greater_keys = str_list("greater_keys", greater_keys, self._default_greater_keys)
        self.less_keys = str_list("less_keys", less_keys, self._default_less_keys)
        self.published_keys = str_list("published_keys", published_keys, None)
        self.save_best = save_best_list(save_best)
        self.rules: list[str | None] = rule_list(rule, self.save_best)
        self._waiting = False  # a save fell inside an accumulation window it cannot keep: at the window's end
        self.key_indicators: list[str] = []
        if self.save_best is not None:
            self._init_rule(self.rules, self.save_best)
        self.last_ckpt: Path | None = None
        self.keep_ckpt_ids: list[int] = []  # the numbers of the periodic checkpoints kept, oldest first

    @property
    def filename_tmpl(self) -> str:
        return self._filename_tmpl or ("epoch_{}.pth" if self.by_epoch else "iter_{}.pth")

    def _init_rule(self, rules: list[str | None], key_indicators: list[str]) -> None:
        """One rule per key (a single rule is shared); None is decided as MMEngine does, case-insensitively:
        the key equal to a greater key, then to a less key, then containing a greater key, then a less key."""
        if len(rules) == 1:
            rules = rules * len(key_indicators)
        greater = {k.lower() for k in self.greater_keys}
        less = {k.lower() for k in self.less_keys}
        self.rules = []
        for rule, key in zip(rules, key_indicators, strict=True):
            if rule is None and key != "auto":
                lc = key.lower()
                rule = ("greater" if lc in greater else "less" if lc in less else
                        "greater" if any(k in lc for k in greater) else "less" if any(k in lc for k in less) else None)
                if rule is None:
                    raise ConfigError(f"{_WHERE}.rule: cannot infer whether a greater or a smaller {key!r} is better "
                                      "(no greater_keys/less_keys entry matches it): set rule='greater' or 'less'")
            self.rules.append(rule)
        self.key_indicators = list(key_indicators)

    # -- periodic checkpoints ------------------------------------------------------------------
    def before_train(self, runner: Any) -> None:
        if self.by_epoch and not runner.train_loop.by_epoch:
            self.by_epoch = False  # an iteration-based run has no epoch ends to save at
        work_dir = Path(runner.work_dir)
        self.out_dir = work_dir if self._out_arg is None else _out_subdir(self._out_arg, work_dir)
        if self.out_dir != work_dir:
            runner.logger.info(f"Checkpoints will be saved to {self.out_dir}")
        self._check_format(runner)
        if dist.is_main_process():
            for folder in {work_dir, self.out_dir}:
                _remove_stale_temp_files(runner, folder)
        if self.max_keep_ckpts > 0:
            self.keep_ckpt_ids = self._restored_ids(runner)
            self._prune(runner)  # a resume with a smaller max_keep_ckpts deletes the surplus, as MMEngine

    def _check_format(self, runner: Any) -> None:
        """Another run's checkpoint under a name this run will write, in the other form (file or directory),
        stops the run now rather than at that save; rank 0 looks, every rank stops."""
        from memfit.checkpoint.workdir import format_clash
        from memfit.errors import CheckpointError

        done = runner.epoch if self.by_epoch else runner.iter
        sharded = runner.strategy.capabilities.sharded_checkpoints
        clash = format_clash(self.out_dir, self.filename_tmpl, done, sharded) if dist.is_main_process() else None
        clash = dist.broadcast_object(clash)
        if clash is not None:
            raise CheckpointError(clash)

    def _restored_ids(self, runner: Any) -> list[int]:
        """``keep_ckpt_ids`` of the checkpoint resumed from; one saved without them (by an older memfit)
        stands for the run's checkpoints on disk numbered up to the resumed position."""
        hub = runner.message_hub
        if "keep_ckpt_ids" in hub.runtime_info:
            return [int(n) for n in hub.get_info("keep_ckpt_ids")]
        done = runner.epoch if self.by_epoch else runner.iter
        if done == 0:
            return []
        from memfit.checkpoint.workdir import find_checkpoints

        before, after = self.filename_tmpl.split("{}")
        numbers = (p.name[len(before):len(p.name) - len(after)] for p in find_checkpoints(self.out_dir,
                                                                                            self.filename_tmpl))
        return [n for n in map(int, numbers) if n <= done]

    def after_train_epoch(self, runner: Any) -> None:
        if not self.by_epoch:
            return
        if self.every_n_epochs(runner, self.interval, self.save_begin) or (
            self.save_last and self.is_last_train_epoch(runner)
        ):
            runner.logger.info(f"Saving checkpoint at {runner.epoch + 1} epochs")
            self._save_periodic(runner, runner.epoch + 1, dict(epoch=runner.epoch + 1, iter=runner.iter))

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        if self.by_epoch:
            return
        if self.every_n_train_iters(runner, self.interval, self.save_begin) or (
            self.save_last and self.is_last_train_iter(runner)
        ) or self._waiting:
            if save_waits(runner):  # exact resume needs the window's partial gradients, which it cannot save
                if not self._waiting:
                    runner.logger.info(f"checkpoint due at {runner.iter + 1} iterations waits for the end of the "
                                       f"accumulation window ({type(runner.strategy).__name__} keeps its partial "
                                       "gradients in its own buffers)")
                self._waiting = True
                return
            self._waiting = False
            runner.logger.info(f"Saving checkpoint at {runner.iter + 1} iterations")
            self._save_periodic(runner, runner.iter + 1, dict(epoch=runner.epoch, iter=runner.iter + 1))

    def _save_periodic(self, runner: Any, step: int, meta: dict) -> None:
        self.last_ckpt = self.out_dir / self.filename_tmpl.format(step)
        runner.message_hub.update_info("last_ckpt", str(self.last_ckpt))
        if self.max_keep_ckpts > 0:
            # Saved with the checkpoint are also the numbers about to be deleted (deleted only once the
            # new checkpoint is complete), so a run resumed after a kill in between deletes them.
            self.keep_ckpt_ids = [n for n in self.keep_ckpt_ids if n != step] + [step]
            runner.message_hub.update_info("keep_ckpt_ids", list(self.keep_ckpt_ids))
        self._write(runner, self.last_ckpt, meta)
        if self.max_keep_ckpts > 0:
            self._prune(runner)

    def _prune(self, runner: Any) -> None:
        """Delete the oldest of ``keep_ckpt_ids`` beyond ``max_keep_ckpts``, except a best checkpoint and
        the one ``last_checkpoint`` names (a background save may not have replaced it yet): those stay
        listed, to be deleted by a later save."""
        from memfit.checkpoint.workdir import latest_target

        protect = {p.resolve() for p in [*self._best_paths(runner), latest_target(runner.work_dir) or self.last_ckpt]
                   if p is not None}
        surplus = len(self.keep_ckpt_ids) - self.max_keep_ckpts
        kept = []
        for i, n in enumerate(self.keep_ckpt_ids):
            path = Path(self.out_dir) / self.filename_tmpl.format(n)
            if i >= surplus or path.resolve() in protect:
                kept.append(n)
            elif dist.is_main_process() and path.exists():
                _remove(path)
                runner.logger.debug(f"max_keep_ckpts={self.max_keep_ckpts}: removed {path.name}")
        self.keep_ckpt_ids = kept
        runner.message_hub.update_info("keep_ckpt_ids", kept)

    def _write(self, runner: Any, path: Path, meta: dict) -> None:
        runner.save_checkpoint(str(path), meta=meta, save_optimizer=self.save_optimizer,
                               save_param_scheduler=self.save_param_scheduler)
        self._adopt_pointer(runner)

    def _adopt_pointer(self, runner: Any) -> None:
        """A strategy that finalises a background save points ``last_checkpoint`` from the checkpoint's own
        folder; with an out_dir, move that pointer to the work dir, where ``resume=True`` reads it."""
        from memfit.checkpoint.workdir import LATEST_FILE, latest_target, write_latest

        stray = Path(self.out_dir) / LATEST_FILE
        if Path(self.out_dir) == Path(runner.work_dir) or not dist.is_main_process() or not stray.is_file():
            return
        target = latest_target(self.out_dir)
        if target is not None:
            write_latest(runner.work_dir, target)
        stray.unlink(missing_ok=True)

    def after_run(self, runner: Any) -> None:
        if isinstance(self.out_dir, Path) and runner.train_loop is not None:
            self._adopt_pointer(runner)  # a background save finalised at the end of training

    # -- best checkpoints ----------------------------------------------------------------------
    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        if not self.save_best or runner.train_loop is None:
            return
        if not metrics:
            runner.logger.warning("save_best: the validation returned no metrics, no best checkpoint is saved")
            return
        if "auto" in self.key_indicators:
            self._init_rule(self.rules, [next(iter(metrics))])
        unit, n = ("epoch", runner.epoch) if self.by_epoch else ("iter", runner.iter)
        hub, single = runner.message_hub, len(self.key_indicators) == 1
        improved = []
        for key, rule in zip(self.key_indicators, self.rules, strict=True):
            metric = self._metric_key(key, metrics)
            if metrics[metric] is None:
                continue
            score = float(metrics[metric])
            score_key, ckpt_key = ("best_score", "best_ckpt") if single else (f"best_score_{key}", f"best_ckpt_{key}")
            if not self.rule_map[rule](score, hub.get_info(score_key, self.init_value_map[rule])):
                continue
            path = self.out_dir / f"best_{metric}_{self.filename_tmpl.format(n)}".replace("/", "_")
            improved.append((metric, score, hub.get_info(ckpt_key), path))
            hub.update_info(score_key, score)
            hub.update_info(ckpt_key, str(path))
        # Every new best is recorded before the first save, so that each checkpoint holds them all
        # (a run resumed from it must not save the same best again).
        for metric, score, previous, path in improved:
            self._write(runner, path, dict(epoch=runner.epoch, iter=runner.iter))
            if previous and dist.is_main_process():
                from memfit.checkpoint.workdir import latest_target

                old = self.out_dir / Path(previous).name  # the folder may have moved since it was recorded
                if old != path and old != latest_target(runner.work_dir):
                    _remove(old)
            runner.logger.info(f"The best checkpoint with {score:.4f} {metric} at {n} {unit} is saved to {path.name}")

    def check_loops(self, runner: Any) -> None:
        """``out_dir`` can be written (else the first save failed), and ``save_best`` names a metric the validation
        returns, where its evaluator says which before it runs (an unknown name would stop the run at its first
        validation, after an epoch of training); the Runner calls it once its loops are built."""
        if self._out_arg is not None:  # rank 0 looks; every rank stops
            folder = _out_subdir(self._out_arg, Path(runner.work_dir))
            problem = dist.broadcast_object(unwritable(folder) if dist.is_main_process() else None)
            if problem:
                raise ConfigError(f"{_WHERE}.out_dir={str(self._out_arg)!r}: cannot create {folder} ({problem}): set "
                                  "out_dir to a writable folder")
        evaluator = getattr(getattr(runner, "val_loop", None), "evaluator", None)
        names = evaluator.metric_names() if self.save_best and hasattr(evaluator, "metric_names") else None
        # A hook of the user's may add to the metrics it is given after validating (MMEngine passes the same dict).
        if not names or any(_overridden(h, "after_val_epoch") and not type(h).__module__.startswith("memfit.hooks.")
                            for h in runner.hooks):
            return
        for key in self.key_indicators:
            if key != "auto":
                self._metric_key(key, dict.fromkeys(names))

    def _metric_key(self, key: str, metrics: dict) -> str:
        if key in metrics:
            return key
        prefixed = [k for k in metrics if k.startswith(f"{key}/")]
        if prefixed:
            return prefixed[0]
        raise ConfigError(f"{_WHERE}.save_best={key!r} is not a metric; metrics are: {', '.join(metrics)}")

    def _best_paths(self, runner: Any) -> list[Path]:
        info = runner.message_hub.runtime_info
        return [Path(self.out_dir) / Path(v).name for k, v in info.items()
                if (k == "best_ckpt" or k.startswith("best_ckpt_")) and v]

    # -- published copies ----------------------------------------------------------------------
    def after_train(self, runner: Any) -> None:
        if self.published_keys is None:
            return
        runner.strategy.finalize_checkpoints()  # a collective: the last checkpoint may be written in the background
        self._adopt_pointer(runner)
        if not dist.is_main_process():
            return
        last = [self.last_ckpt] if self.save_last and self.last_ckpt is not None else []
        for path in last + (self._best_paths(runner) if self.save_best else []):
            self._publish(runner, path)

    def _publish(self, runner: Any, path: Path) -> None:
        """MMEngine's ``_publish_model``: a copy with ``published_keys`` only, named by its content's hash.
        A sharded checkpoint directory is gathered into that one file in this process (as ``memfit export``)."""
        from memfit.checkpoint import atomic_path
        from memfit.checkpoint.export import read_checkpoint
        from memfit.errors import CheckpointError

        try:
            state = read_checkpoint(path, with_optimizer="optim_wrapper" in self.published_keys)
        except CheckpointError as exc:
            runner.logger.warning(f"published_keys: {path} not published: {exc}")
            return
        removed = [k for k in state if k not in self.published_keys]
        state = {k: v for k, v in state.items() if k in self.published_keys}
        if removed:
            runner.logger.info(f"Key {removed} will be removed because they are not found in published_keys. "
                               f"If you want to keep them, please set `{removed}` in published_keys")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        final = path.with_name(f"{path.stem}-{hashlib.sha256(buffer.getvalue()).hexdigest()[:8]}.pth")
        with atomic_path(final) as tmp:
            tmp.write_bytes(buffer.getvalue())
        runner.logger.info(f"The checkpoint ({path}) is published to {final}.")


def _out_subdir(out_dir: str | Path, work_dir: Path) -> Path:
    """MMEngine's placement: ``out_dir/<last folder of work_dir>``, or the work dir itself when given."""
    out = Path(out_dir).resolve()
    return work_dir if out == work_dir.resolve() else out / work_dir.name


def _remove(path: Path) -> None:
    """Delete a checkpoint file or sharded checkpoint directory, if it is there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_temp_files(runner: Any, folder: Path) -> None:
    """Delete the temporary files and directories of saves that a kill interrupted (they can be as
    large as a checkpoint), or put back a checkpoint a kill left set aside. Safe at the start of
    training: no save of this run is in flight yet."""
    from memfit.checkpoint.directory import TEMP_PATTERN, recover

    with contextlib.suppress(OSError):
        for path, action in recover(folder):
            what = f"{path.name} as {TEMP_PATTERN.match(path.name)['name']}" if action == "restored" else path.name
            runner.logger.warning(f"{action} {what}: left by a save that was interrupted")
