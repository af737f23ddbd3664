"""A composed row's allocations under its sharding, through the simulated CUDA allocator.

FSDP2 and ZeRO-2 allocate beside the activations on the default stream too (unsharded parameters at each
unit's all-gather, the reduce-scatter's input, the whole gradients until their reduce-scatter takes them), so
what a row's activations leave free there is not what they leave on one device. The sharding's step of the
reference activations recorded its allocator calls, each tagged the sharding's own or the model's operators'
(:class:`~memfit.planner.sync_points.ShardTrace`), with the sync points between them. :class:`ShardedSteps` runs
that step with the model's calls of each stretch between two points replaced by the row's composed ones of the
same stretch: the sharding's calls stay where they were among the activations' (:class:`_Shares`: after the same
share of the stretch's model allocations, then of its frees), and the whole gradients it frees at a reduce-scatter
are the row's gradients, in the order they are made. Then the optimizer's calls, and the whole step again on the
segments it left, as the sharding's own step is replayed (:meth:`CachingAllocatorModel.replay`). The reference
activations give back the sharding's own step, call for call.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable
from typing import Any

from memfit.measure import CachingAllocatorModel
from memfit.planner.recompute import STEP_AT
from memfit.planner.step_calls import INPUT_STREAM
from memfit.planner.sync_points import STEP, ShardTrace

_GRAD = -1  # a row event's nbytes where its storage became a gradient (memfit.planner.recompute._replay)


def _stretches(events: list[tuple[Any, Any, Any]]) -> list[list[tuple[Any, Any, Any]]]:
    """A composed row's events (``recompute._replay``'s) split at its sync points."""
    out: list[list[tuple[Any, Any, Any]]] = [[]]
    for ev in events:
        if ev[0] is None:
            out.append([])
        else:
            out[-1].append(ev)
    return out


def _handed(st: ShardTrace) -> dict[int, int]:
    """Of the sharding's frees of storages the model's operators made (the whole gradients its reduce-scatters
    take), the trace index of each free -> which such storage it is, by when it was made (0, 1, ...)."""
    made: dict[Hashable, int] = {}
    frees: dict[int, int] = {}
    for i in range(st.first, st.end):
        key, nbytes = st.trace[i]
        if nbytes is not None:
            made[key] = i
        elif key in made:
            at = made.pop(key)
            if st.own[i - st.first] and not st.own[at - st.first]:
                frees[i] = at
    order = {at: g for g, at in enumerate(sorted(frees.values()))}
    return {i: order[at] for i, at in frees.items()}


def _copy(row: list[tuple[Any, Any, Any]], c: int) -> list[tuple[Any, Any, Any]]:
    """``row`` as micro-step ``c`` of gradient accumulation (its keys its own); after the first, what becomes a
    gradient is a temporary, freed as it is made (autograd adds it into the gradient the first micro-step made)."""
    if c == 0:
        return [ev if ev[0] is None or ev[1] == _GRAD else (("row", ev[0]), ev[1], ev[2]) for ev in row]
    out = []
    for key, nbytes, stream in row:
        if key is None:
            out.append((None, nbytes, stream))
        else:
            out.append((("row", c, key), None if nbytes == _GRAD else nbytes, stream))
    return out


class _Shares:
    """Where in a stretch's composed ``events`` a sharding call goes that came after ``seen`` = (allocations, frees)
    of the ``model``'s (its stretch's totals) in the recorded step: after the same share of the row's allocations,
    then through the frees that follow (up to the same share of its frees) before its next allocation. Allocations
    and frees apart: a checkpointed row's backward stretch starts with the recomputation's frees, which come before
    the next unit's all-gather, as the row's own step makes them. The reference's own events give back the recorded
    order."""

    def __init__(self, events: list[tuple[Any, Any, Any]], model: tuple[int, int]) -> None:
        self.model = model
        self.mallocs = [i for i, ev in enumerate(events) if ev[1] is not None and ev[1] != _GRAD]
        self.freed = [0]  # frees among the first i events
        for ev in events:
            self.freed.append(self.freed[-1] + (ev[1] is None))

    def __call__(self, seen: tuple[int, int]) -> int:
        (made, freed), (model_made, model_freed) = seen, self.model
        k = len(self.mallocs) * made // model_made if model_made else 0
        at = self.mallocs[k - 1] + 1 if k else 0
        stop = self.mallocs[k] if k < len(self.mallocs) else len(self.freed) - 1
        want = self.freed[-1] * freed // model_freed if model_freed else 0
        return bisect_left(self.freed, want, at, stop)  # the first point from ``at`` with that many frees before it


class RowCalls:
    """A composed row's calls (``recompute.compose``'s events) split at its sync points, as each micro-step of
    gradient accumulation runs them (:func:`_copy`), each made once; ``grads``: its gradients' keys, in order. The
    calls after its backward returned (its ``tail``, after :data:`~memfit.planner.recompute.STEP_AT`) come after the
    optimizer step in the micro-step that ends with it (:meth:`step`'s ``last``)."""

    def __init__(self, row: list[tuple[Any, Any, Any]]) -> None:
        cut = row.index(STEP_AT) if STEP_AT in row else len(row)
        self.row, self._tail = row[:cut], row[cut + 1:]
        self.grads = [("row", key) for key, nbytes, _ in row if nbytes == _GRAD]
        self._steps: dict[tuple[int, bool], list[list[tuple[Any, Any, Any]]]] = {}

    def step(self, c: int, last: bool = False) -> list[list[tuple[Any, Any, Any]]]:
        if (c, last) not in self._steps:
            self._steps[(c, last)] = _stretches(_copy(self.row if last else self.row + self._tail, c))
        return self._steps[(c, last)]

    def tail(self, c: int) -> list[tuple[Any, Any, Any]]:
        """Micro-step ``c``'s calls after its backward returned."""
        return _copy(self._tail, c)


class ShardedSteps:
    """A recorded sharded step (``st``) that runs composed forward/backward steps in place of its activations (see
    the module docstring): its own calls of each stretch between two sync points, each with how many of the
    stretch's model calls came before it, are worked out once."""

    def __init__(self, st: ShardTrace) -> None:
        self.st = st
        handed = _handed(st)
        cuts = [st.first, *st.points, st.end]
        # per stretch: (its model allocations and frees, [(model allocations and frees before, key, nbytes, stream,
        # gradient handed or -1)])
        self.stretches: list[tuple[tuple[int, int], list[tuple[tuple[int, int], Any, Any, Any, int]]]] = []
        mine: set[Hashable] = set()  # the storages the sharding made: its own, whoever frees them
        for lo, hi in zip(cuts, cuts[1:]):
            own, made, freed = [], 0, 0
            for i in range(lo, hi):
                key, nbytes = st.trace[i]
                # the batches (on their copy stream) are the step's, at the row's micro-batch (``run``)
                if not st.own[i - st.first] and not (nbytes is None and key in mine) and \
                        st.streams.get(i, 0) != INPUT_STREAM:
                    made, freed = (made, freed + 1) if nbytes is None else (made + 1, freed)
                    continue
                if nbytes is None:
                    mine.discard(key)
                else:
                    mine.add(key)
                own.append(((made, freed), key, nbytes, st.streams.get(i, 0), handed.get(i, -1)))
            self.stretches.append(((made, freed), own))

    def run(self, row: list[tuple[Any, Any, Any]] | RowCalls, optimizer: bool = True, micro_steps: int = 1,
            inputs: float = 1.0) -> CachingAllocatorModel | None:
        """The simulated allocator after two training steps of the recorded sharding with the composed
        forward/backward ``row`` (``recompute.compose``'s events) in place of its activations; None where the two
        do not have the same sync points. ``optimizer`` False: the optimizer is on the host (its state and step
        allocate nothing on the device; what it frees, it frees). ``micro_steps`` 2 or more: the step accumulates
        (the recorded one over two micro-steps); more than 2 runs a middle micro-step too (the first's calls of the
        sharding, which does not reduce its gradients until the last; the allocator's segments settle there).
        ``inputs``: the row's micro-batch over the recorded step's (its batches' size)."""
        st = self.st
        cut = st.kinds.index(STEP) + 1 if STEP in st.kinds else len(self.stretches)
        groups = [self.stretches[:cut], self.stretches[cut:]] if micro_steps > 1 else [self.stretches]
        if micro_steps > 2:
            groups.insert(1, groups[0])
        calls = row if isinstance(row, RowCalls) else RowCalls(row)
        steps = [calls.step(c, last=c == len(groups) - 1) for c in range(len(groups))]
        tail = calls.tail(len(groups) - 1)
        if any(len(g) != len(r) for g, r in zip(groups, steps)):
            return None
        grads = calls.grads
        allocator = CachingAllocatorModel()
        malloc, free = allocator.malloc, allocator.free
        alias: dict[Hashable, Hashable] = {}  # a recorded key -> the block its latest copy holds

        def shard_call(key: Hashable, nbytes: int | None, stream: Hashable, c: int) -> None:
            if nbytes is None:
                free(alias.pop(key, ("shard", key)))
            elif key not in alias:  # a middle micro-step's copy of what the first made and still holds: held
                alias[key] = ("shard", c, key)
                malloc(alias[key], int(nbytes * inputs) if stream == INPUT_STREAM else nbytes, stream)

        for i in range(st.first):
            shard_call(*st.trace[i], st.streams.get(i, 0), -1)
        first = len(allocator.trace)

        def run_row(events: list[tuple[Any, Any, Any]]) -> None:
            for key, nbytes, stream in events:
                if nbytes is None:
                    free(key)
                elif nbytes != _GRAD:
                    malloc(key, nbytes, stream)

        for c, (group, rows) in enumerate(zip(groups, steps)):
            for (model, own), events in zip(group, rows):
                done, at = 0, _Shares(events, model)
                for seen, key, nbytes, stream, handed in own:
                    upto = at(seen)
                    if upto > done:
                        run_row(events[done:upto])
                        done = upto
                    if handed < 0:
                        shard_call(key, nbytes, stream, c)
                    elif handed < len(grads):
                        free(grads[handed])
                run_row(events[done:])
        late = {key for key, nbytes, _ in tail if nbytes is None}
        for key in allocator.held_since(first):  # what the row still holds: gradients zero_grad frees
            if key[0] == "row" and key not in late:
                free(key)
        for i in range(st.end, len(st.trace)):  # the optimizer's step: on what the step made and kept
            key, nbytes = st.trace[i]
            if nbytes is None or optimizer:
                shard_call(key, nbytes, st.streams.get(i, 0), len(groups))
        run_row(tail)  # then the train step returns
        allocator.replay(first)
        return allocator


class ShardedRows:
    """Composed rows' simulated allocator figures in their sharding's step, each run once: rows of one sharding,
    optimizer and activations share them (either anchor's step of one sharding holds the same buffers of its own;
    the activations are the row's)."""

    def __init__(self) -> None:
        self.figures: dict[tuple, tuple[int, int, int] | None] = {}
        self._steps: dict[int, ShardedSteps] = {}  # by id of the ShardTrace (the planner's runs keep it)
        self._events: tuple[Hashable, RowCalls] | None = None  # the last activations' (rows come in their order)

    def __call__(self, st: ShardTrace, acts: Hashable, sharding: Hashable, optimizer: bool, micro_steps: int,
                 events: Callable[[], list[tuple]], inputs: float = 1.0) -> tuple[int, int, int] | None:
        """(peak allocated, peak reserved, peak requested) of the activations ``acts`` (``events()``: their calls) in
        the step ``st`` of the sharding ``sharding`` (:meth:`ShardedSteps.run`'s ``optimizer``, ``micro_steps`` and
        ``inputs``); None where they cannot run in it."""
        done = (sharding, acts, optimizer, micro_steps)
        if done not in self.figures:
            if self._events is None or self._events[0] != acts:
                self._events = (acts, RowCalls(events()))
            steps = self._steps.get(id(st))
            if steps is None:
                steps = self._steps[id(st)] = ShardedSteps(st)
            allocator = steps.run(self._events[1], optimizer, micro_steps, inputs)
            self.figures[done] = None if allocator is None else \
                (allocator.peak_allocated, allocator.reserved_beside_strays(), allocator.peak_requested)
        return self.figures[done]
