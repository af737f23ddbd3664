"""Composing a prediction's rows in several processes: once its fake steps have run, each plan's row is pure
Python over their recordings (the simulated allocator's replays take most of it: Swin-L's 721 rows at 8 ranks,
about 40 s on one core). Processes forked then inherit the recordings and the composer's caches; rows of the same
activations, which share their composition, go to the same process; each process takes the next such group,
costliest first, until none is left. Written here because ``multiprocessing.Pool`` pickles what its jobs take,
and the recordings are hundreds of megabytes."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from memfit.planner.composer import Composer
from memfit.planner.results import PlanResult
from memfit.planner.row_allocator import activations_key
from memfit.planner.runs import StepFailed
from memfit.planner.space import Plan

Row = PlanResult | StepFailed


def _groups(plans: list[Plan]) -> list[list[tuple[int, Plan]]]:
    """``plans`` (with their index) grouped by their activations, costliest group first: a sharded row runs its
    sharding's step in the simulated allocator, several times the work of another."""
    groups: dict[tuple, list[tuple[int, Plan]]] = {}
    for i, p in enumerate(plans):
        groups.setdefault(activations_key(p, p.micro_batch), []).append((i, p))

    def cost(group: list[tuple[int, Plan]]) -> int:
        return sum(4 if p.sharding in ("zero2", "fsdp") else 1 for _, p in group)

    return sorted(groups.values(), key=cost, reverse=True)


def _row(compose: Composer, plan: Plan) -> Row:
    try:
        return compose(plan)
    except StepFailed as exc:
        return exc


def _taken(counter: Any, n: int) -> Iterator[int]:
    """The indices of the groups this process takes, each once over all processes."""
    while True:
        with counter.get_lock():
            g = counter.value
            counter.value += 1
        if g >= n:
            return
        yield g


def _serve(conn: Connection, compose: Composer, groups: list[list[tuple[int, Plan]]], counter: Any) -> None:
    # Never the parent's fake-step workers: a step missing here (none should be) runs in this process.
    compose.runs.pool, compose.runs.forked = None, False
    rows: dict[int, Row] = {}
    try:
        for g in _taken(counter, len(groups)):
            rows.update((i, _row(compose, p)) for i, p in groups[g])
    except Exception:  # noqa: BLE001 - what is done comes back; the parent composes the rest, where a bug raises
        pass
    conn.send(rows)
    conn.close()


def compose_all(compose: Composer, plans: list[Plan], processes: int) -> list[tuple[Plan, Row]]:
    """Each of ``plans`` with its row (or the :class:`StepFailed` its composition raised), in :meth:`Composer.in_order`,
    composed in up to ``processes`` processes (forked where the fake steps' workers are; else here, one by one)."""
    plans = compose.in_order(plans)
    groups = _groups(plans)
    extra = min(processes, len(groups)) - 1
    if extra < 1 or not compose.runs.forked:
        return [(p, _row(compose, p)) for p in plans]
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("i", 0)
    children = []
    for _ in range(extra):
        conn, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_serve, args=(child, compose, groups, counter), daemon=True)
        process.start()
        child.close()
        children.append((conn, process))
    rows: dict[int, Row] = {}
    for g in _taken(counter, len(groups)):
        rows.update((i, _row(compose, p)) for i, p in groups[g])
    for conn, process in children:
        try:
            rows.update(conn.recv())
        except EOFError:  # the process died (out of memory, killed): its groups are composed below
            pass
        conn.close()
        process.join()
    return [(p, rows[i] if i in rows else _row(compose, p)) for i, p in enumerate(plans)]
