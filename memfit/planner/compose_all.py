"""Composing a prediction's rows in several processes: once its fake steps have run, each plan's row is pure
Python over their recordings (the simulated allocator's replays take most of it: Swin-L's 721 rows at 8 ranks,
about 40 s on one core). Processes forked then inherit the recordings and the composer's caches; rows of the same
activations, which share their composition, go to the same process; each process takes the next such group,
costliest first, until none is left. Written here because ``multiprocessing.Pool`` pickles what its jobs take,
and the recordings are hundreds of megabytes."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from memfit.planner.composer import Composer
from memfit.planner.results import PlanResult
from memfit.planner.row_allocator import activations_key
from memfit.planner.runs import Runs, StepFailed
from memfit.planner.space import Plan
from memfit.planner.stuck import dump_stack_on_request, wait_answer

Row = PlanResult | StepFailed
T = TypeVar("T")
R = TypeVar("R")
Groups = list[list[tuple[int, T]]]


def groups(plans: list[Plan]) -> Groups[Plan]:
    """``plans`` (with their index) grouped by their activations, costliest group first: a sharded row runs its
    sharding's step in the simulated allocator, several times the work of another."""
    out: dict[tuple, list[tuple[int, Plan]]] = {}
    for i, p in enumerate(plans):
        out.setdefault(activations_key(p, p.micro_batch), []).append((i, p))

    def cost(group: list[tuple[int, Plan]]) -> int:
        return sum(4 if p.sharding in ("zero2", "fsdp") else 1 for _, p in group)

    return sorted(out.values(), key=cost, reverse=True)


def _taken(counter: Any, n: int) -> Iterator[int]:
    """The indices of the groups this process takes, each once over all processes."""
    while True:
        with counter.get_lock():
            g = counter.value
            counter.value += 1
        if g >= n:
            return
        yield g


def _serve(conn: Connection, runs: Runs, work: Groups, fn: Callable, counter: Any) -> None:
    # Never the parent's fake-step workers: a step missing here (none should be) runs in this process, on one thread
    # (the parent's OpenMP threads are not in this fork: a parallel region would wait for them forever).
    runs.pool, runs.forked = None, False
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (this daemon ends with it)
    dump_stack_on_request()
    out: dict[int, Any] = {}
    try:
        for g in _taken(counter, len(work)):
            out.update((i, fn(x)) for i, x in work[g])
    except Exception:  # noqa: BLE001 - what is done comes back; the parent does the rest, where a bug raises
        pass
    conn.send(out)
    conn.close()


def in_processes(work: Groups[T], fn: Callable[[T], R], processes: int, runs: Runs) -> dict[int, R]:
    """``fn`` of each item of ``work`` (groups of ``(index, item)``), by index, in up to ``processes`` processes:
    forked where ``runs``' fake-step workers are (this process has run no backward), else here, one by one. What a
    process that dies or is stuck (:mod:`memfit.planner.stuck`) leaves undone is done here. ``fn``'s results are
    pickled back."""
    extra = min(processes, len(work)) - 1
    if extra < 1 or not runs.forked:
        return {i: fn(x) for group in work for i, x in group}
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)
    children = []
    for _ in range(extra):
        conn, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_serve, args=(child, runs, work, fn, counter), daemon=True)
        process.start()
        child.close()
        children.append((conn, process))
    out: dict[int, R] = {}
    for g in _taken(counter, len(work)):
        out.update((i, fn(x)) for i, x in work[g])
    for conn, process in children:
        try:
            if wait_answer(conn, process.pid, process.is_alive, "row-composing process"):
                out.update(conn.recv())
        except EOFError:  # the process died (out of memory, killed) or was stuck: its groups are done below
            pass
        conn.close()
        process.join()
    out.update((i, fn(x)) for group in work for i, x in group if i not in out)
    return out


def _row(compose: Composer, plan: Plan) -> Row:
    try:
        return compose(plan)
    except StepFailed as exc:
        return exc


def compose_all(compose: Composer, plans: list[Plan], processes: int) -> list[tuple[Plan, Row]]:
    """Each of ``plans`` with its row (or the :class:`StepFailed` its composition raised), in :meth:`Composer.in_order`,
    composed in up to ``processes`` processes (:func:`in_processes`)."""
    plans = compose.in_order(plans)
    rows = in_processes(groups(plans), lambda p: _row(compose, p), processes, compose.runs)
    return [(p, rows[i]) for i, p in enumerate(plans)]
