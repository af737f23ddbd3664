"""Activation checkpointing composed from one recorded forward/backward, instead of a fake step per choice.

Non-reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``, what memfit applies)
changes three things about a region's memory, and nothing else:

1. in forward, what autograd saves inside the region is not kept (a holder stands in for it): a tensor made
   in the region lives as long as the program holds it, or something outside the region saved it;
2. the region's checkpoint frame keeps the region's inputs until the last of those holders is released;
3. in backward, when the first of those holders is unpacked, the region's forward runs again up to the last
   tensor it saves (torch's early stop); the tensors it saves stay until their holders are released, the
   rest are freed as the program drops them, or when the recomputation stops.

Selective checkpointing adds a fourth: the outputs of the operators its policy keeps stay from forward and
are handed back in the recomputation instead of run again (torch refuses it in backward if an in-place
operator wrote to one meanwhile).

So one forward/backward *without* checkpointing, recorded (:mod:`memfit.planner.timeline`), gives the same
step with any set of regions checkpointed: :func:`compose` rebuilds the allocations and frees of a choice
from the timeline and replays them through the tracker's accounting and the simulated CUDA allocator. No
choice (``compose(t, ())``) is the uncheckpointed step itself. Checked against running each choice in
tests/planner/test_recompute.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from memfit.measure import CachingAllocatorModel
from memfit.planner.step_calls import bucket_calls
from memfit.planner.sync_points import SyncProfile, later_profile
from memfit.planner.timeline import ALLOC, FREE, OP, SCRATCH, Timeline


@dataclass
class Composed:
    """A composed forward/backward: the tracked peak, the counter's figures (recomputation included) and,
    with an allocator prefix, the simulated CUDA allocator's peaks."""

    peak: int
    flops: int
    ops: int
    written: int
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    cuda_requested: int = 0  # with an epilogue: the bytes the two steps requested at their peak
    recompute_ops: int = 0  # of ``ops``: the recomputations' (and their saved tensors' detaches)
    peak_without_grads: int = 0  # the peak of all but the gradients (LiveStorages.peak_without_grads)
    sync: SyncProfile | None = None  # the tracked bytes at the recording's sync points, where it has them


# In a composed step's events: its backward returned here (a full step's optimizer step goes here).
STEP_AT = (None, "optimizer step", 0)


class CachedTensorMutated(RuntimeError):
    """Selective checkpointing keeps a tensor that an in-place operator then overwrites: torch refuses it in
    backward, with this message."""


def compose(tl: Timeline, regions: Iterable[str], selective: bool = False,
            epilogue: list[tuple[int, int | None]] | None = None, micro_steps: int = 1,
            events: list[tuple] | None = None, before: tuple[int, ...] = ()) -> Composed:
    """The recorded step with the calls of the modules named in ``regions`` checkpointed (a call inside
    another checkpointed one is not checkpointed again, as memfit's install never wraps twice).

    ``selective``: torch's selective checkpointing with memfit's policy (the outputs of the GEMM and attention
    operators are kept from forward and not recomputed: ``DEFAULT_SAVE_OPS``); raises
    :class:`CachedTensorMutated` where that step would fail.

    ``epilogue``: an optimizer step's allocator calls (:func:`memfit.planner.step_calls.optimizer_epilogue`); with it
    the simulated allocator runs two training steps, as a real run's second step finds the segments: the
    composed forward/backward, the optimizer step (its state kept, the step's leftovers freed as
    ``zero_grad`` frees the gradients), then both again on those segments; with ``micro_steps`` > 1 each step
    runs the forward/backward again as a later micro-step (its gradients added in place) before the optimizer's.

    ``events``: a list given is filled with the composed step's allocations and frees in order (see :func:`_replay`).
    ``before``: blocks of these sizes the simulated allocator holds from before the step (DDP's buckets)."""
    names = set(regions)
    ix = tl.index
    chosen = {c for c, name in enumerate(tl.calls) if name in names}
    chosen = {c for c in chosen if not chosen.intersection(tl.parents[c])}
    end = (ix.end, 1, 0)
    # When each storage is freed, as (index, phase, seq): after event ``index`` (phase 1), or at step ``seq``
    # of a recomputation run just before it (phase -1). By default when the program drops it.
    free = {uid: (i, 1, 0) for uid, i in ix.free_at.items()}

    def hold(uid: int, until: tuple[int, int, int]) -> None:
        free[uid] = max(free.get(uid, end), until)

    # 1-2: holders saved inside a checkpointed call are dropped; its frame keeps its inputs until its last
    # holder is released (or until it returns, when it saved nothing).
    frame: dict[int, int] = {}
    for c in chosen:
        frame[c] = max((ix.release(h) for h in ix.packs.get(c, [])), default=ix.exit.get(c, ix.end))
        for uid in ix.enter[c][1]:
            hold(uid, (frame[c], 1, 0))
    for uid, hids in ix.holders.items():
        for h in hids:
            if not chosen.intersection(ix.saved[h][1]):
                hold(uid, (ix.release(h), 1, 0))
    items: list[tuple] = []  # (index, phase, seq, alloc?, key, nbytes, retroactive)
    flops, ops, written = ix.flops, ix.ops, ix.written
    for c in sorted(chosen):
        more = _recompute(tl, c, frame[c], selective, items, hold)
        flops, ops, written = flops + more[0], ops + more[1], written + more[2]
    recompute_ops = ops - ix.ops
    for i, uid, nbytes, retro in ix.allocs:
        items.append((i, 0, 0, True, uid, nbytes, retro))
        at = free.get(uid, end)
        if at < end:
            items.append((*at, False, uid, 0, False))
    for i, sizes in ix.scratch:
        _scratch(items, (i, 0), 0, ("scratch", i), sizes)
    items += [(i, 1, 0, None, uid, 0, False) for i, uid in ix.grads]  # is_alloc None: it became a gradient
    items += [(i, 0, 0, "sync", (kind, ident), 0, False) for i, kind, ident in ix.sync]
    return replace(_replay(tl, items, flops, ops, written, epilogue, micro_steps, events, before),
                   recompute_ops=recompute_ops)


def _recompute(tl: Timeline, c: int, frame: int, selective: bool, items: list[tuple],
               hold: Any) -> tuple[int, int, int]:
    """3: checkpointed call ``c``, which backward reaches, runs its forward again when its first holder is
    unpacked: its allocations and frees go into ``items``; the (FLOPs, ops, bytes written) it adds. Under
    selective checkpointing the kept operators' outputs stay from forward (``hold``) and are not run again."""
    ix = tl.index
    hids = ix.packs.get(c, [])
    start = ix.enter[c][0]
    cached = {u for u in ix.cached if start < ix.alloc_at[u] < ix.exit.get(c, ix.end)} if selective else set()
    # Through checkpoint's hooks saved outputs are not detached when saved, unpacks are (as recorded); selective
    # checkpointing detaches each output it keeps.
    ops = sum((h in ix.detached) - ix.saved[h][4] for h in hids) + len(cached)
    unpacks = [ix.unpacked[h] for h in hids if h in ix.unpacked]
    if not unpacks:
        for uid in cached:
            hold(uid, (frame, 1, 0))
        return 0, ops, 0
    at, last = min(unpacks), max(ix.saved[h][2] for h in hids)
    for uid in cached:
        if ix.alloc_at[uid] > last:  # never reached: kept until the frame goes
            hold(uid, (frame, 1, 0))
        elif any(ix.alloc_at[uid] < w < at for w in ix.writes.get(uid, ())):
            raise CachedTensorMutated("Tensor cached during selective activation checkpoint has been mutated")
    # uid -> when the recomputed tensor is let go: checkpoint hands it to the backward function that unpacks it
    # and keeps no reference (freed when that function returns); one never unpacked stays with its holder.
    needed: dict[int, int] = {}
    for h in hids:
        uid = ix.saved[h][0]
        if uid is not None:
            needed[uid] = max(needed.get(uid, -1), ix.dropped.get(h, ix.release(h)))
    ops += sum(ix.saved[h][3] for h in hids)  # the recomputation's hook detaches what requires grad
    flops = written = seq = 0
    made: list[int] = []
    live: set[int] = set()
    for i, ev in enumerate(tl.events[start + 1:last], start + 1):
        kind = ev[0]
        if kind == SCRATCH:
            seq = _scratch(items, (at, -1), seq, (c, "scratch", i), ev[1])
        elif kind == OP:
            if not (selective and ev[3]):  # a kept operator is not run again
                flops, ops, written = flops + ev[1], ops + 1, written + ev[2]
        elif kind == ALLOC and not ev[3]:
            seq += 1
            if ev[1] not in cached:
                items.append((at, -1, seq, True, (c, ev[1]), ev[2], False))
            made.append(ev[1])
            live.add(ev[1])
        elif kind == FREE and ev[1] in live and ev[1] not in needed:
            seq += 1
            live.discard(ev[1])
            if ev[1] in cached:
                hold(ev[1], (at, -1, seq))
            else:
                items.append((at, -1, seq, False, (c, ev[1]), 0, False))
    seq += 1
    for uid in made:
        until = (needed[uid], 1, 0) if uid in needed else (at, -1, seq) if uid in live else None
        if until is None:
            continue
        if uid in cached:
            hold(uid, until)
        elif until[0] < ix.end:
            items.append((*until, False, (c, uid), 0, False))
    return flops, ops, written


def _scratch(items: list[tuple], at: tuple[int, int], seq: int, key: tuple, sizes: tuple[int, ...]) -> int:
    """An operator's kernel scratch as items at ``at`` from ``seq`` on: its blocks allocated, then freed in
    reverse; the last seq used."""
    for j, n in enumerate(sizes):
        items.append((*at, seq + 1 + j, True, (*key, j), n, False))
    for j in reversed(range(len(sizes))):
        items.append((*at, seq + 2 * len(sizes) - j, False, (*key, j), 0, False))
    return seq + 2 * len(sizes)


def _replay(tl: Timeline, items: list[tuple], flops: int, ops: int, written: int,
            epilogue: list[tuple[int, int | None]] | None = None, micro_steps: int = 1,
            events: list[tuple] | None = None, before: tuple[int, ...] = ()) -> Composed:
    """The tracker's accounting over the composed allocations and frees: the peak is taken after each
    allocation (after each operator's outputs, as the tracker does); a retroactive one (alive before the
    step, first seen now) raises the peak too. The simulated allocator runs them, and with ``epilogue`` two
    steps (:func:`compose`). ``events`` (a list): gets ``(key, nbytes, stream)`` for each allocation,
    ``(key, None, 0)`` for each free, ``(key, -1, 0)`` where a storage becomes a gradient, ``(None, kind, 0)``
    at each sync point and :data:`STEP_AT` where the backward returned, in order; a retroactive allocation (alive
    before the step) is left out."""
    items.sort(key=lambda it: it[:3])
    allocator = None
    if tl.prefix is not None:
        allocator = CachingAllocatorModel.rerun(*tl.prefix)
        allocator.run(bucket_calls(before))
    total = peak = peak_ng = tl.start
    grads = 0  # the bytes of storages that became gradients
    gradients: set[Any] = set()
    first = len(allocator.trace) if allocator is not None else 0
    sizes: dict[Any, int] = {}
    kinds: list[int] = []
    ids: list[Any] = []
    # The sync points' figures (SyncProfile), and without the gradients (those of a later micro-step)
    start, at, peaks, at_ng, peaks_ng = tl.start, [], [tl.start], [], [tl.start]
    # The calls after the backward returned (the train step letting go of its batch and losses) come after the
    # optimizer's step, which a full step runs before the train step returns.
    tail_at = tl.index.end if tl.step_at is None else tl.step_at
    tail: list[tuple] = []
    marked = events is None
    for i, _, _, is_alloc, key, n, retro in items:
        if not marked and i >= tail_at:
            events.append(STEP_AT)  # type: ignore[union-attr]
            marked = True
        if events is not None and not retro:
            if is_alloc == "sync":
                events.append((None, key[0], 0))
            elif is_alloc is None:
                events.append((key, -1, 0))
            else:
                events.append((key, n, tl.streams.get(key, 0)) if is_alloc else (key, None, 0))
        if is_alloc == "sync":
            kinds.append(key[0])
            ids.append(key[1])
            at.append(total)
            peaks.append(total)
            at_ng.append(total - grads)
            peaks_ng.append(total - grads)
        elif is_alloc is None:
            if key in sizes and key not in gradients:
                gradients.add(key)
                grads += sizes[key]
        elif is_alloc:
            sizes[key] = n
            total += n
            if retro:
                peak, peak_ng = peak + n, peak_ng + n
                # alive since the start: at every point so far too
                start, at, peaks = start + n, [a + n for a in at], [p + n for p in peaks]
                at_ng, peaks_ng = [a + n for a in at_ng], [p + n for p in peaks_ng]
            # (comparisons, not max(): this loop runs once per allocation of every composed row)
            if total > peak:
                peak = total
            if total > peaks[-1]:
                peaks[-1] = total
            if total - grads > peak_ng:
                peak_ng = total - grads
            if total - grads > peaks_ng[-1]:
                peaks_ng[-1] = total - grads
            if allocator is not None:
                if i >= tail_at:
                    tail.append((("step", key), n, tl.streams.get(key, 0)))
                else:
                    allocator.malloc(("step", key), n, tl.streams.get(key, 0))
        else:
            freed = sizes.pop(key)
            total -= freed
            if key in gradients:
                gradients.discard(key)
                grads -= freed
            if allocator is not None:
                if i >= tail_at:
                    tail.append((("step", key), None, 0))
                else:
                    allocator.free(("step", key))
    sync = None
    if kinds:  # a later micro-step holds the whole gradients from its start; its own are added into them
        later = later_profile(kinds, start, at_ng, peaks_ng, grads, ids)
        sync = SyncProfile(tuple(kinds), start, tuple(at), tuple(peaks), later=later, ids=tuple(ids))
    if allocator is None:
        return Composed(peak, flops, ops, written, peak_without_grads=peak_ng, sync=sync)
    requested = 0
    if epilogue is not None:
        allocator.finish_steps(first, epilogue, allocator.held_since(first), micro_steps, tail)
        requested = allocator.peak_requested
    else:
        allocator.run(tail)
    return Composed(peak, flops, ops, written, allocator.peak_allocated, allocator.reserved_beside_strays(), requested,
                    peak_without_grads=peak_ng, sync=sync)
