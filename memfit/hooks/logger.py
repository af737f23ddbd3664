"""LoggerHook: the console line of MMEngine's logs (as in its large-model training guide), a progress bar,
JSON lines and TensorBoard."""

from __future__ import annotations

import datetime
import json
import logging
import resource
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memfit.dist import is_main_process
from memfit.errors import ConfigError, ConfigTypeError, type_or_value_error
from memfit.hooks.base import Hook, check_local_storage, check_switches
from memfit.registry import HOOKS

_WHERE = "default_hooks.logger"


def peak_memory_mb(device: torch.device, reset: bool = True) -> int:
    """Peak CUDA allocation (reset after the read unless ``reset=False``) on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        mb = torch.cuda.max_memory_allocated(device) // 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(mb)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


@HOOKS.register()
class LoggerHook(Hook):
    """Every ``interval`` iterations: ``Epoch(train) [1][ 10/196]  lr: ...  eta: ...  time: ...``.

    The first iteration a run executes (the first of the run, or the first after a resume) also gets
    that line, on the console and in the log file only, so a log (CI, a batch job) shows progress, time
    and memory at once; the lines every ``interval`` iterations, their smoothing window and what they
    write to the scalar files are unchanged (the early line does not reset the peak-memory counter).

    Scalars (smoothed over the last ``window_size`` iterations, default: the interval; MMEngine's
    ``log_processor.window_size``) also go to ``<log_dir>/scalars.jsonl`` and, when
    ``tensorboard=True``, to TensorBoard in ``<log_dir>/tensorboard``. A progress bar is shown when
    stdout is a terminal (``progress_bar=None`` decides automatically).

    MMEngine's arguments: ``ignore_last=True`` skips the line of an epoch's last iterations unless
    the epoch is no longer than the interval (memfit's default False logs them); ``Exp name: ...`` is
    logged every ``interval_exp_name`` iterations and at the end of each epoch; validation metrics
    are written at step ``runner.epoch`` (``log_metric_by_epoch=True``) or ``runner.iter``. With
    ``out_dir``, the log dir's files ending in ``out_suffix`` are copied to ``out_dir/<work_dir's last
    folder>/`` after the run (and deleted locally with ``keep_local=False``); the default suffixes
    are MMEngine's plus ``.jsonl`` (memfit's scalars file). Only local disk: ``backend_args`` /
    ``file_client_args`` warn.
    """

    priority = "BELOW_NORMAL"

    def __init__(self, interval: int = 10, tensorboard: bool = True, progress_bar: bool | None = None,
                 ignore_last: bool = False, window_size: int | None = None, interval_exp_name: int = 1000,
                 out_dir: str | Path | None = None,
                 out_suffix: str | Sequence[str] = (".json", ".jsonl", ".log", ".py", "yaml"),
                 keep_local: bool = True, file_client_args: dict | None = None, log_metric_by_epoch: bool = True,
                 backend_args: dict | None = None) -> None:
        # MMEngine's LoggerHook: TypeError for a wrong type, ValueError for a value < 1.
        if type(interval) is not int or interval < 1:
            raise type_or_value_error(f"interval={interval!r}: use an int >= 1 (iterations between log lines)",
                                      type(interval) is not int)
        if type(interval_exp_name) is not int or interval_exp_name < 1:
            raise type_or_value_error(f"{_WHERE}.interval_exp_name={interval_exp_name!r}: use an int >= 1 "
                                      "(iterations between 'Exp name' lines)", type(interval_exp_name) is not int)
        check_switches(_WHERE, ignore_last=ignore_last, keep_local=keep_local, log_metric_by_epoch=log_metric_by_epoch)
        if not (isinstance(out_suffix, str) or (isinstance(out_suffix, list | tuple)
                                                and all(isinstance(x, str) for x in out_suffix))):
            raise ConfigTypeError(f"{_WHERE}.out_suffix={out_suffix!r}: use a str or a tuple of str, "
                                  "e.g. ('.log', '.py')")
        if out_dir is None and file_client_args is not None:
            raise ConfigError(f"{_WHERE}.file_client_args is set without out_dir: remove it (it only applies to "
                              "out_dir)")
        check_local_storage(_WHERE, out_dir, backend_args, file_client_args)
        self.interval = interval
        self.window_size = window_size
        self.tensorboard = tensorboard
        self.progress_bar = progress_bar
        self.ignore_last = ignore_last
        self.interval_exp_name = interval_exp_name
        self.out_dir, self.keep_local, self.log_metric_by_epoch = out_dir, keep_local, log_metric_by_epoch
        self.out_suffix = out_suffix if isinstance(out_suffix, str) else tuple(out_suffix)
        self._out: Path | None = None
        self._json = None
        self._tb = None
        self._bar = None
        self._last_val: dict[str, float] = {}
        self._started = time.perf_counter()
        self._first_iter: int | None = None

    # -- files ---------------------------------------------------------------------------------
    def before_run(self, runner: Any) -> None:
        if not is_main_process():
            return
        log_dir = Path(runner.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        if self.out_dir is not None:  # MMEngine joins the work dir's last folder, always
            self._out = Path(self.out_dir).resolve() / Path(runner.work_dir).name
            runner.logger.info(f"Text logs will be saved to {self._out} after the training process.")
        self._json = open(log_dir / "scalars.jsonl", "a")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(log_dir / "tensorboard"))
            except ImportError:  # tensorboard is a dependency, but stay usable without it
                runner.logger.warning("tensorboard is not installed: scalars go to scalars.jsonl only")

    def after_run(self, runner: Any) -> None:
        for f in (self._json, self._tb):
            if f is not None:
                f.close()
        self._json = self._tb = None
        self._close_bar()
        if self._out is not None and is_main_process():
            self._copy_out(runner)

    def _copy_out(self, runner: Any) -> None:
        """MMEngine's after_run: copy the log dir's files ending in ``out_suffix`` (sub-folders too) to
        ``out_dir/<work_dir name>/``, keeping their relative paths; with ``keep_local=False`` delete them."""
        log_dir = Path(runner.log_dir)
        copied = []
        for path in sorted(p for p in log_dir.rglob("*") if p.is_file() and p.name.endswith(self.out_suffix)):
            target = self._out / path.relative_to(log_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            copied.append(path)
            runner.logger.info(f"The file {path} has been uploaded to {target}.")
        if self.keep_local or not copied:
            return
        runner.logger.info(f"keep_local=False: removing the local copies; the logs are in {self._out}")
        for handler in list(runner.logger.handlers):  # close the log file first (a later line would reopen it)
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == log_dir:
                runner.logger.removeHandler(handler)
                handler.close()
        for path in copied:
            path.unlink(missing_ok=True)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        if self._json is not None:
            self._json.write(json.dumps({"step": step, **scalars}) + "\n")
            self._json.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    # -- train ---------------------------------------------------------------------------------
    def before_train(self, runner: Any) -> None:
        self._started = time.perf_counter()
        self._first_iter = runner.iter  # logged early (see the class docstring)
        what = "peak CUDA memory allocated" if runner.device.type == "cuda" else "peak process RSS (CPU)"
        runner.logger.info(f"'memory' in log lines: {what}, in MB")
        if is_main_process() and (self.progress_bar or (self.progress_bar is None and sys.stdout.isatty())):
            from tqdm import tqdm

            self._bar = tqdm(total=runner.max_iters, initial=runner.iter, desc="train", leave=False,
                             dynamic_ncols=True, file=sys.stderr)

    def after_train(self, runner: Any) -> None:
        self._close_bar()
        took = datetime.timedelta(seconds=int(time.perf_counter() - self._started))
        summary = f"Training finished: {runner.iter} iterations in {took}"
        if self._last_val:
            summary += "; last validation: " + "  ".join(f"{k}: {v:.4f}" for k, v in self._last_val.items())
        runner.logger.info(summary)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        hub = runner.message_hub
        if outputs:
            hub.update_scalars({f"train/{k}": v for k, v in outputs.items()})
        if runner.optim_wrapper is not None:
            hub.update_scalars({f"train/{k}": v for k, v in runner.optim_wrapper.log_scalars().items()})
        if self._bar is not None:
            self._bar.update(1)
        loop = runner.train_loop
        last_in_epoch = loop.is_last_iter_of_epoch(batch_idx)
        if self.every_n_train_iters(runner, self.interval_exp_name) or last_in_epoch:
            runner.logger.info(f"Exp name: {runner.experiment_name or runner.timestamp}")
        due = (self.every_n_inner_iters(batch_idx, self.interval) if loop.by_epoch
               else self.every_n_train_iters(runner, self.interval))
        # MMEngine: an epoch's last, incomplete interval is logged unless ignore_last, and always when the
        # whole epoch is no longer than the interval.
        regular = due or (last_in_epoch and (not self.ignore_last or loop.iters_per_epoch <= self.interval))
        if not (regular or runner.iter == self._first_iter):
            return
        window = self.window_size or self.interval
        scalars: dict[str, float] = {}
        if runner.optim_wrapper is not None:  # MMEngine's: each entry of get_lr() (base_lr, lr, <name>.lr)
            scalars.update({name: values[0] for name, values in runner.optim_wrapper.get_lr().items() if values})
        for key in hub.keys("train/"):
            name = key.removeprefix("train/")
            scalars[name] = hub.latest(key) if name in ("loss_scale", "skipped_steps") else hub.mean(key, window)
        for key in hub.keys("memory/"):  # MemoryMonitorHook's tracker numbers, when it is on
            scalars[key] = hub.latest(key)
        scalars["memory"] = peak_memory_mb(runner.device, reset=regular)
        scalars["epoch"] = runner.epoch + 1
        scalars["iter"] = runner.iter + 1
        if regular:
            self._write(runner.iter + 1, scalars)
        runner.logger.info(self._format_train(runner, batch_idx, scalars))

    def _format_train(self, runner: Any, batch_idx: int, s: dict[str, float]) -> str:
        if runner.train_loop.by_epoch:
            n = runner.train_loop.iters_per_epoch
            head = f"Epoch(train)  [{runner.epoch + 1}][{batch_idx + 1:>{len(str(n))}}/{n}]"
        else:
            n = runner.max_iters
            head = f"Iter(train)  [{runner.iter + 1:>{len(str(n))}}/{n}]"
        eta = str(datetime.timedelta(seconds=int(runner.message_hub.get_info("eta", 0.0))))
        parts = [head]
        lrs = [k for k in s if k == "lr" or k.endswith(("base_lr", ".lr"))]  # MMEngine's: base_lr, lr, <name>.lr
        parts.extend(f"{k}: {s[k]:.4e}" for k in lrs)
        parts.append(f"eta: {eta}")
        for k in ("time", "data_time"):
            if k in s:
                parts.append(f"{k}: {s[k]:.4f}")
        parts.append(f"memory: {int(s['memory'])}")
        skip = {*lrs, "time", "data_time", "memory", "epoch", "iter"}
        rest = [f"{k}: {v:.4f}" for k, v in s.items() if k not in skip and k != "loss"]
        if "loss" in s:
            parts.append(f"loss: {s['loss']:.4f}")
        return "  ".join(parts + rest)

    # -- val / test ----------------------------------------------------------------------------
    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        self._after_eval(runner, "val", metrics or {})

    def after_test_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        self._after_eval(runner, "test", metrics or {})

    def _after_eval(self, runner: Any, mode: str, metrics: dict) -> None:
        hub = runner.message_hub
        scalars = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if mode == "val":
            self._last_val = dict(scalars)
        for k in ("data_time", "time"):
            if hub.keys(f"{mode}/{k}"):
                scalars[k] = hub.mean(f"{mode}/{k}")
        if mode == "val":  # MMEngine's step: the epoch or iteration count the validation follows (0 without training)
            step = runner.epoch if self.log_metric_by_epoch else runner.iter
            self._write(step, {f"val/{k}": v for k, v in scalars.items()})
        n = len(runner.val_dataloader if mode == "val" else runner.test_dataloader)
        head = (f"Epoch({mode}) [{max(runner.epoch, 1)}][{n}/{n}]" if runner.train_loop_by_epoch
                else f"Iter({mode}) [{n}/{n}]")
        body = "  ".join(f"{k}: {v:.4f}" for k, v in scalars.items())
        runner.logger.info(f"{head}  {body}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
