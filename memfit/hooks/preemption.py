"""PreemptionHook: on SIGTERM or SIGUSR1, save a checkpoint at the end of the iteration on every rank and stop.

A hook rather than code in the loop: it needs nothing the loop does not already offer (the end of an
iteration, the runner's ``save_checkpoint``), MMEngine users turn a default hook off with
``default_hooks=dict(preemption=None)``, and the loop stays data -> step -> hooks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from memfit import dist
from memfit.errors import ConfigError, Preempted, type_or_value_error
from memfit.hooks.base import Hook, save_waits
from memfit.registry import HOOKS

_WHERE = "default_hooks.preemption"
# Signals closer together than this are one request: under Slurm every process of a job step gets the
# SIGTERM, and torchrun forwards its own to the workers as well.
_REPEAT_S = 1.0


@HOOKS.register()
class PreemptionHook(Hook):
    """Catch ``signals`` while training; at the end of the iteration in which one arrived, save, then raise
    :class:`~memfit.errors.Preempted` (``memfit train`` exits with status 75).

    The handler only records the signal. After every ``interval``-th iteration the ranks agree whether any
    of them received one (an all-reduce of one integer on a CPU tensor over a gloo group: no device
    synchronisation; a single process just reads the flag), so all of them stop after the same iteration,
    save ``iter_<n>.pth`` through the strategy (sharded and background saves included, finalized before
    the exception) and point ``last_checkpoint`` at it; ``resume=True`` continues at the next batch.

    The handlers are installed when the training loop starts (main thread only) and the previous ones
    restored when ``train()`` returns or raises. A SIGTERM at least a second after the signal that asked
    for the stop ends the process as it would have ended without memfit (the previous handler; by default
    death by SIGTERM).
    """

    priority = "LOWEST"  # after the logger and the CheckpointHook have seen the iteration

    def __init__(self, interval: int = 1, signals: Sequence[str] = ("SIGTERM", "SIGUSR1")) -> None:
        if type(interval) is not int or interval < 1:
            raise type_or_value_error(f"{_WHERE}.interval={interval!r}: use an int >= 1 (check every N iterations)",
                                      type(interval) is not int)
        names = [signals] if isinstance(signals, str) else list(signals)
        for name in names:
            if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ConfigError(f"{_WHERE}.signals: {name!r} is not a signal of this platform: use e.g. "
                                  "'SIGTERM', 'SIGUSR1'")
        self.interval = interval
        self.signals = [getattr(signal, name) for name in names]
        self._received: int = 0  # the first signal caught (0: none)
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._stopping = 0  # the agreed signal, while the run finishes its accumulation window

    # -- the handlers --------------------------------------------------------------------------
    def before_train(self, runner: Any) -> None:
        self.restore_handlers()  # never keep our own handler as "the previous one"
        self._received, self._stopping = 0, 0
        self._group = dist.cpu_group()  # a collective, on every rank, before the first iteration
        if threading.current_thread() is not threading.main_thread():
            runner.logger.warning("PreemptionHook: train() runs outside the main thread, where Python cannot "
                                  "install signal handlers: a preemption signal is not caught")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._received:
            self._received, self._received_at = signum, time.monotonic()
            return
        if signum == signal.SIGTERM and time.monotonic() - self._received_at >= _REPEAT_S:
            previous = self._previous.get(signum)
            self.restore_handlers()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # SIG_DFL, or a handler not set from Python: die by the signal
                os.kill(os.getpid(), signum)

    def restore_handlers(self) -> None:
        """Put back the handlers that were installed before training (idempotent)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def after_train(self, runner: Any) -> None:
        self.restore_handlers()

    def after_run(self, runner: Any) -> None:
        self.restore_handlers()

    # -- stopping ------------------------------------------------------------------------------
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        if self._stopping:  # agreed already; every rank is at the same place in the window
            signum = self._stopping
        elif not self.every_n_train_iters(runner, self.interval):
            return
        else:
            signum = dist.all_reduce_max_int(self._received, self._group)
        if not signum:
            return
        if save_waits(runner):
            if not self._stopping and dist.is_main_process():
                runner.logger.warning(f"preemption: {signal.Signals(signum).name} received; finishing the accumulation "
                                      f"window first ({type(runner.strategy).__name__} cannot save its partial "
                                      "gradients)")
            self._stopping = signum
            return
        self._stop(runner, signum)

    def _stop(self, runner: Any, signum: int) -> None:
        """Save where the run stands (the next batch is the first one of the resumed run), then raise."""
        done = runner.iter + 1
        where = f"after iteration {done}" + (f" (epoch {runner.epoch + 1})" if runner.train_loop_by_epoch else "")
        got = [rank for rank, received in enumerate(dist.all_gather_object(self._received)) if received]
        path = runner.save_checkpoint(f"iter_{done}.pth", meta=dict(epoch=runner.epoch, iter=done))
        runner.strategy.finalize_checkpoints()  # a background save becomes last_checkpoint before we leave
        # No rank leaves before rank 0 has pointed last_checkpoint at it: torchrun stops the others (SIGTERM)
        # as soon as one process exits with a non-zero status.
        dist.all_reduce_max_int(0, self._group)
        name = signal.Signals(signum).name
        ranks = "" if dist.get_world_size() == 1 else f" on rank{'s' if len(got) > 1 else ''} " + \
            ",".join(map(str, got))
        message = (f"preempted: {name} received{ranks}; stopped {where} and saved {path} "
                   "(last_checkpoint names it): resume with `memfit train CFG --resume` or resume=True")
        if dist.is_main_process():
            runner.logger.warning(message)
        raise Preempted(message, signal_name=name, iteration=done, checkpoint=str(path))
