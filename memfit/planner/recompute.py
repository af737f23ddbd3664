"""Activation checkpointing composed from one recorded forward/backward, instead of a fake step per choice.

Non-reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``, what memfit applies)
changes three things about a region's memory, and nothing else:

1. in forward, what autograd saves inside the region is not kept (a holder stands in for it): a tensor made
   in the region lives as long as the program holds it, or something outside the region saved it;
2. the region's checkpoint frame keeps the region's inputs until the last of those holders is released;
3. in backward, when the first of those holders is unpacked, the region's forward runs again up to the last
   tensor it saves (torch's early stop); the tensors it saves stay until their holders are released, the
   rest are freed as the program drops them, or when the recomputation stops.

So one forward/backward *without* checkpointing, recorded, gives the same step with any set of regions
checkpointed. The recording run's saved-tensor hooks keep no step tensor (they keep its metadata and make
an empty one of that shape when backward asks), so the tracker sees each storage freed exactly when the
program drops it. Beside that the timeline holds: which region each tensor was saved in, when it is unpacked
and released, the regions' calls and inputs, and each operator's FLOPs. :func:`compose` rebuilds the
allocations and frees of a choice from it and replays them through the tracker's accounting and the
simulated CUDA allocator. No choice (``compose(t, ())``) is the uncheckpointed step itself.

Selective checkpointing, which keeps some operators' outputs by policy, is not composed: it is run.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from memfit.memory.caching_allocator import CachingAllocatorModel

_DETACH = torch.ops.aten.detach.default

# Timeline events, in program order (tuples; ``uid`` names a storage for the whole recording).
ALLOC = 0  # (ALLOC, uid, nbytes, retroactive): a storage made (or, retroactive, first seen: alive before)
FREE = 1  # (FREE, uid): the program dropped it (nothing the recording saved holds it)
OP = 2  # (OP, flops, written, cached): an operator the counter counted (cached: selective checkpointing keeps it)
PACK = 3  # (PACK, hid, uid, calls, requires_grad, output): autograd saved a tensor, inside these region calls
UNPACK = 4  # (UNPACK, hid, detached): backward asked for it (and autograd detached what the hook gave)
RELEASE = 5  # (RELEASE, hid): autograd dropped what it saved
ENTER = 6  # (ENTER, call, input uids): a region's forward began (``calls[call]`` is its module's name)
EXIT = 7  # (EXIT, call)
WRITE = 8  # (WRITE, uid): an in-place operator wrote to the storage


class _Saved:
    """What the recording keeps of a saved tensor: its metadata, or the tensor itself when its storage was
    alive before the step (parameters, the batch), which checkpointing does not free either."""

    __slots__ = ("hid", "shape", "stride", "dtype", "tensor", "__weakref__")

    def __init__(self, hid: int, t: torch.Tensor, keep: bool) -> None:
        self.hid = hid
        self.tensor = t if keep else None
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype


@dataclass
class Timeline:
    """One recorded forward/backward (see the module docstring). ``start``: tracked bytes alive when the
    recording began; ``prefix``: the simulated CUDA allocator's calls before it (None without one);
    ``calls``: the module name of each region call; ``parents``: the calls enclosing each call."""

    events: list[tuple] = field(default_factory=list)
    start: int = 0
    prefix: list[tuple] | None = None
    calls: list[str] = field(default_factory=list)
    parents: list[tuple[int, ...]] = field(default_factory=list)

    @cached_property
    def index(self) -> _Index:
        return _Index(self)


class Recorder:
    """Records a :class:`Timeline` of the forward/backward run inside it.

    ``regions``: the modules whose calls are windows a choice may checkpoint; ``allocator``: the simulated
    CUDA allocator, whose calls so far are the timeline's prefix; ``mode``: the tracker's live-storage mode
    (its allocations and frees are the timeline's), set before entering. :meth:`observe` wraps the operator
    counter, which the tracker is given as its observer."""

    def __init__(self, regions: dict[str, nn.Module], allocator: CachingAllocatorModel | None = None,
                 mode: Any = None) -> None:
        self.mode, self.regions, self.allocator = mode, regions, allocator
        self.timeline = Timeline()
        self.events = self.timeline.events
        self._uids: dict[int, int] = {}  # id(storage) -> uid, while it lives
        self._fresh: set[int] = set()  # uids made during the recording (not alive before it)
        self._next = 0
        self._stack: list[int] = []
        self._calls: tuple[int, ...] = ()
        self._refs: dict[int, weakref.ref] = {}
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._unpacked = 0  # id of the storage the last unpack handed to autograd
        from memfit.memory.checkpointing import DEFAULT_SAVE_OPS, resolve_ops

        self._kept = frozenset(resolve_ops(DEFAULT_SAVE_OPS))  # what selective checkpointing keeps
        self._written: dict[Any, tuple[int, ...]] = {}  # op -> the positions of the arguments it writes

    # -- the tracker's allocations and frees --------------------------------------------------------------
    def alloc(self, key: int, nbytes: int, retroactive: bool) -> None:
        self._next += 1
        self._uids[key] = self._next
        if not retroactive:
            self._fresh.add(self._next)
        self.events.append((ALLOC, self._next, nbytes, retroactive))

    def free(self, key: int) -> None:
        uid = self._uids.pop(key, None)
        if uid is not None:
            self.events.append((FREE, uid))

    def observe(self, counter: Any) -> Any:
        """``counter`` (the planner's operator counter) as an observer that also records each operator."""

        def observer(func: Any, args: Any, kwargs: Any, out: Any) -> None:
            flops, written, ops = counter.flops, counter.written, counter.ops
            counter(func, args, kwargs, out)
            if counter.ops == ops:
                return
            if func is _DETACH and self.events and self.events[-1][0] == UNPACK and \
                    id(args[0].untyped_storage()) == self._unpacked:
                # Autograd detaches what a saved-tensor hook unpacks: the hook's operator, not the step's (a
                # checkpointed region's unpacks go through hooks, so it is counted there).
                self.events[-1] = (UNPACK, self.events[-1][1], True)
                return
            self.events.append((OP, counter.flops - flops, counter.written - written, func in self._kept))
            for i in self._writes(func):
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].layout is torch.strided:
                    uid = self._uids.get(id(args[i].untyped_storage()))
                    if uid is not None:
                        self.events.append((WRITE, uid))

        return observer

    def _writes(self, func: Any) -> tuple[int, ...]:
        if func not in self._written:
            args = func._schema.arguments
            self._written[func] = tuple(i for i, a in enumerate(args) if a.alias_info is not None
                                        and a.alias_info.is_write and not a.kwarg_only)
        return self._written[func]

    # -- autograd's saved tensors --------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> _Saved:
        uid = self._uids.get(id(t.untyped_storage())) if t.layout is torch.strided else None
        if uid not in self._fresh:
            uid = None
        hid = self._packs
        self._packs += 1
        saved = _Saved(hid, t, keep=uid is None)
        self._refs[hid] = weakref.ref(saved, lambda r, hid=hid: self._release(hid))
        # An operator's output saved for backward (the operator's allocation just before): without hooks, autograd
        # saves it through a detach, an operator the step runs that the recording does not.
        last = self.events[-1] if self.events else None
        output = uid is not None and last is not None and last[0] == ALLOC and last[1] == uid
        self.events.append((PACK, hid, uid, self._calls, t.requires_grad, output))
        return saved

    def _release(self, hid: int) -> None:
        if self._refs.pop(hid, None) is not None:
            self.events.append((RELEASE, hid))

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self.events.append((UNPACK, saved.hid, False))
        if saved.tensor is not None:
            self._unpacked = id(saved.tensor.untyped_storage())
            return saved.tensor
        self.mode.metadata_only += 1  # an empty stand-in, not memory of the step
        try:
            with torch.no_grad():
                t = torch.empty_strided(saved.shape, saved.stride, dtype=saved.dtype)
        finally:
            self.mode.metadata_only -= 1
        st = t.untyped_storage()
        key = self._unpacked = id(st)
        self.mode.stand_ins.add(key)  # backward's operators take it: not an input alive before the step
        weakref.finalize(st, self.mode.stand_ins.discard, key)
        return t

    # -- region calls ----------------------------------------------------------------------------------------
    def _enter(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        from memfit.memory.storages import storages

        call = len(self.timeline.calls)
        self.timeline.calls.append(name)
        self.timeline.parents.append(self._calls)
        inputs = tuple({u for st in storages((args, kwargs)) if (u := self._uids.get(id(st))) is not None})
        self.events.append((ENTER, call, inputs))
        self._stack.append(call)
        self._calls = tuple(self._stack)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._stack.pop()
        self._calls = tuple(self._stack)
        self.events.append((EXIT, call))

    def __enter__(self) -> Recorder:
        from functools import partial

        self.timeline.start = self.mode.total
        self.timeline.prefix = list(self.allocator.trace) if self.allocator is not None else None
        self._packs = 0
        self.mode.timeline = self
        for name, module in self.regions.items():
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self.mode.timeline = None


class _Index:
    """What :func:`compose` looks up, built once per timeline."""

    def __init__(self, tl: Timeline) -> None:
        self.end = len(tl.events)
        self.free_at: dict[int, int] = {}
        self.holders: dict[int, list[int]] = {}  # uid -> hids saving it (made during the step)
        self.saved: dict[int, tuple[int | None, tuple[int, ...], int, bool, bool]] = {}  # hid -> uid, calls, i, rg, out
        self.detached: set[int] = set()  # hids whose unpack autograd detached
        self.unpacked: dict[int, int] = {}  # hid -> first unpack
        self.released: dict[int, int] = {}
        self.enter: dict[int, tuple[int, tuple[int, ...]]] = {}  # call -> index, input uids
        self.exit: dict[int, int] = {}
        self.packs: dict[int, list[int]] = {}  # call -> hids saved inside it
        self.allocs: list[tuple[int, int, int, bool]] = []  # (index, uid, nbytes, retroactive)
        self.alloc_at: dict[int, int] = {}
        self.cached: set[int] = set()  # uids made by an operator selective checkpointing keeps
        self.writes: dict[int, list[int]] = {}  # uid -> indices of in-place writes to it
        self.flops = self.ops = self.written = 0
        kept = False
        for i, ev in enumerate(tl.events):
            kind = ev[0]
            if kind == ALLOC:
                self.allocs.append((i, ev[1], ev[2], ev[3]))
                self.alloc_at[ev[1]] = i
                if kept and not ev[3]:
                    self.cached.add(ev[1])
            elif kind == OP:
                self.flops, self.ops, self.written = self.flops + ev[1], self.ops + 1, self.written + ev[2]
                kept = ev[3]
            elif kind == WRITE:
                self.writes.setdefault(ev[1], []).append(i)
            elif kind == FREE:
                self.free_at[ev[1]] = i
            elif kind == PACK:
                hid, uid, calls = ev[1], ev[2], ev[3]
                self.saved[hid] = (uid, calls, i, ev[4], ev[5])
                self.ops += ev[5]
                if uid is not None:
                    self.holders.setdefault(uid, []).append(hid)
                for c in calls:
                    self.packs.setdefault(c, []).append(hid)
            elif kind == UNPACK:
                self.unpacked.setdefault(ev[1], i)
                if ev[2]:
                    self.detached.add(ev[1])
            elif kind == RELEASE:
                self.released[ev[1]] = i
            elif kind == ENTER:
                self.enter[ev[1]] = (i, ev[2])
            elif kind == EXIT:
                self.exit[ev[1]] = i

    def release(self, hid: int) -> int:
        return self.released.get(hid, self.end)


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


class CachedTensorMutated(RuntimeError):
    """Selective checkpointing keeps a tensor that an in-place operator then overwrites: torch refuses it in
    backward, with this message."""


def compose(tl: Timeline, regions: Iterable[str], selective: bool = False) -> Composed:
    """The recorded step with the calls of the modules named in ``regions`` checkpointed (a call inside
    another checkpointed one is not checkpointed again, as memfit's install never wraps twice).

    ``selective``: torch's selective checkpointing with memfit's policy (the outputs of the GEMM and attention
    operators are kept from forward and not recomputed: ``DEFAULT_SAVE_OPS``); raises
    :class:`CachedTensorMutated` where that step would fail."""
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
    for i, uid, nbytes, retro in ix.allocs:
        items.append((i, 0, 0, True, uid, nbytes, retro))
        at = free.get(uid, end)
        if at < end:
            items.append((*at, False, uid, 0, False))
    return _replay(tl, items, flops, ops, written)


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
    needed: dict[int, int] = {}  # uid -> when its last holder in this call is released
    for h in hids:
        uid = ix.saved[h][0]
        if uid is not None:
            needed[uid] = max(needed.get(uid, -1), ix.release(h))
    ops += sum(ix.saved[h][3] for h in hids)  # the recomputation's hook detaches what requires grad
    flops = written = seq = 0
    made: list[int] = []
    live: set[int] = set()
    kept = False
    for ev in tl.events[start + 1:last]:
        kind = ev[0]
        if kind == OP:
            kept = ev[3] and selective
            if not kept:
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


def _replay(tl: Timeline, items: list[tuple], flops: int, ops: int, written: int) -> Composed:
    """The tracker's accounting over the composed allocations and frees: the peak is taken after each
    allocation (after each operator's outputs, as the tracker does); a retroactive one (alive before the
    step, first seen now) raises the peak too."""
    items.sort(key=lambda it: it[:3])
    allocator = None
    if tl.prefix is not None:
        allocator = CachingAllocatorModel()
        for key, n in tl.prefix:
            if n is None:
                allocator.free(key)
            else:
                allocator.malloc(key, n)
    total = peak = tl.start
    sizes: dict[Any, int] = {}
    for _, _, _, is_alloc, key, n, retro in items:
        if is_alloc:
            sizes[key] = n
            total += n
            if retro:
                peak += n
            peak = max(peak, total)
            if allocator is not None:
                allocator.malloc(("step", key), n)
        else:
            total -= sizes.pop(key)
            if allocator is not None:
                allocator.free(("step", key))
    return Composed(peak, flops, ops, written, allocator.peak_allocated if allocator else 0,
                    allocator.peak_reserved if allocator else 0)
