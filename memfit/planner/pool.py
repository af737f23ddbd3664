"""Forked worker processes that run fake steps, each step sent to the worker whose caches are warm for it.

A process's first fake step of a kind pays for caches its later steps of that kind reuse: FakeTensorMode's
dispatch cache, per shape and dtype (about 1.5 s of a DINO Swin-L step), and under FSDP, DTensor's
sharding propagation of the optimizer's foreach operators over every parameter (about 4 s for DINO's
637 parameters; the same in every FSDP step of a model, whatever its precision or batch). A
``ProcessPoolExecutor`` hands each step to whichever worker is free, so every worker pays every kind,
and it cannot keep a warm worker for a later step (the recommended plan's verification). This pool keeps
its workers for a whole prediction and gives a free worker the step it is warmest for relative to the
other workers, longest first (the standard longest-processing-time rule otherwise). Written here because
neither ``concurrent.futures`` nor ``multiprocessing.Pool`` lets the caller choose the worker.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from memfit.planner.stuck import POLL_S, Watch, dump_stack_on_request, kill_stuck


@dataclass(frozen=True)
class Job:
    """A call to run in a worker: ``fn(*args)``; ``cost`` its run time relative to other jobs when warm;
    ``kinds`` the caches it warms, each with the cost of running cold for it."""

    fn: Callable[..., Any]
    args: tuple
    cost: float
    kinds: dict[Hashable, float] = field(default_factory=dict)


class WorkerDied(RuntimeError):
    """A worker process ended without answering (killed, out of memory)."""


class WorkerStuck(RuntimeError):
    """A worker holding a step stopped running (:mod:`memfit.planner.stuck`); it was killed."""


def _serve(conn: Connection, initializer: Callable[..., None], initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the pool
    dump_stack_on_request()
    initializer(*initargs)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        key, fn, args = message
        try:
            answer = (key, True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the parent, which decides
            answer = (key, False, exc)
        try:
            conn.send(answer)
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle: say so instead
            conn.send((key, False, RuntimeError(f"{type(exc).__name__}: {exc}")))


class _Worker:
    def __init__(self, ctx: Any, initializer: Callable[..., None], initargs: tuple) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, initializer, initargs), daemon=True)
        self.process.start()
        child.close()
        self.warm: set[Hashable] = set()
        self.job: Hashable | None = None

    def cold_cost(self, job: Job) -> float:
        return sum(c for k, c in job.kinds.items() if k not in self.warm)


class Pool:
    """``n`` forked workers, each set up by ``initializer(*initargs)``, kept until :meth:`close`."""

    def __init__(self, n: int, initializer: Callable[..., None], initargs: tuple = ()) -> None:
        ctx = multiprocessing.get_context("fork")
        self.workers = [_Worker(ctx, initializer, initargs) for _ in range(n)]
        self.watch = Watch()

    def _pick(self, idle: list[_Worker], pending: dict[Hashable, Job]) -> tuple[_Worker, Hashable]:
        """The idle worker and job for which the job's cold cost there exceeds its least on any worker by the
        least; longest first. Over all idle workers at once, so a job waits for no one but finds the warm one
        among those free."""
        def extra(worker: _Worker, job: Job) -> float:
            return worker.cold_cost(job) - min(w.cold_cost(job) for w in self.workers)

        return min(((w, k) for w in idle for k in pending),
                   key=lambda wk: (extra(wk[0], pending[wk[1]]), -pending[wk[1]].cost))

    def run(self, jobs: dict[Hashable, Job], done: Callable[[Hashable, bool, Any], bool]) -> None:
        """Run ``jobs``; ``done(key, ok, value)`` gets each result (``ok`` False: ``value`` is the raised
        exception) and returns False to stop handing out jobs (those running still report)."""
        pending = dict(jobs)
        going = True
        while True:
            while going and pending and (idle := [w for w in self.workers if w.job is None]):
                w, key = self._pick(idle, pending)
                w.job, job = key, pending.pop(key)
                w.warm.update(job.kinds)
                w.conn.send((w.job, job.fn, job.args))
                self.watch.started(w.process.pid)
            busy = [w for w in self.workers if w.job is not None]
            if not busy:
                return
            ready = wait([w.conn for w in busy], timeout=POLL_S)
            if not ready:
                self._check(busy)
            for conn in ready:
                w = next(w for w in busy if w.conn is conn)
                try:
                    key, ok, value = conn.recv()
                except EOFError:
                    raise self._died(w) from None
                w.job = None
                going = done(key, ok, value) and going

    def _check(self, busy: list[_Worker]) -> None:
        """Raise for a busy worker that ended (its end of the pipe held open elsewhere) or is stuck."""
        for w in busy:
            if not w.process.is_alive() and not w.conn.poll():
                raise self._died(w)
            if self.watch.stuck(w.process.pid):
                line = kill_stuck(w.process.pid, "fake-step worker process")
                w.process.join(timeout=5)
                raise WorkerStuck(line)

    @staticmethod
    def _died(w: _Worker) -> WorkerDied:
        w.process.join(timeout=5)
        return WorkerDied(f"a planner worker process (pid {w.process.pid}) ended while running a fake step "
                          f"(exit code {w.process.exitcode}); was it out of memory?")

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
