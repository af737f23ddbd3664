"""The timeline of one forward/backward without checkpointing, recorded for :mod:`memfit.planner.recompute`.

The recording run's saved-tensor hooks keep no tensor the step makes: they keep its metadata and hand
backward an empty tensor of that shape (fake tensors have no values), so the tracker sees each storage freed
exactly when the program drops it, which is when checkpointing would free it. In order, the timeline holds
the tracker's allocations and frees, each operator's FLOPs and bytes written (and whether selective
checkpointing's policy keeps its outputs), in-place writes, which region calls were open when autograd
saved each tensor, when each saved tensor is unpacked and released, and the region calls with their inputs.
:class:`Recorder` records it; :class:`Timeline` holds it (picklable: the planner's workers send it back).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from memfit.measure import CachingAllocatorModel, storages
from memfit.memory.checkpointing import DEFAULT_SAVE_OPS, resolve_ops
from memfit.planner.sync_points import install_hooks

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
# (SCRATCH, sizes, spec): the operator just counted took blocks of these bytes while it ran (CUDA targets; spec:
# a reduction's or a norm's arguments, kernel_scratch.Blocks)
SCRATCH = 9
# (DROP, hid): what the unpack of ``hid`` handed backward died (the backward function that asked for it returned:
# where checkpointing frees a recomputed tensor, before autograd sums a broadcast gradient and releases the rest)
DROP = 10
GRAD = 11  # (GRAD, uid): the storage became a parameter's gradient
SYNC = 12  # (SYNC, kind, ident): a point where a sharded step's buffers change (memfit.planner.sync_points)


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
    recording began; ``prefix``: the simulated CUDA allocator's calls before it (``CachingAllocatorModel.calls``;
    None without one); ``streams``: the streams of allocations not on the current one;
    ``calls``: the module name of each region call; ``parents``: the calls enclosing each call; ``step_at``: the
    event where the step's backward had returned (a full step's optimizer step begins there), if it did."""

    events: list[tuple] = field(default_factory=list)
    start: int = 0
    prefix: tuple[list[tuple], dict[int, Hashable]] | None = None
    streams: dict[int, Hashable] = field(default_factory=dict)  # uid -> the stream it was allocated on, if not 0
    calls: list[str] = field(default_factory=list)
    parents: list[tuple[int, ...]] = field(default_factory=list)
    step_at: int | None = None

    @cached_property
    def index(self) -> _Index:
        return _Index(self)


class Recorder:
    """Records a :class:`Timeline` of the forward/backward run inside it.

    ``regions``: the modules whose calls are windows a choice may checkpoint; ``model``: theirs, whose sync points
    (:mod:`memfit.planner.sync_points`) the timeline also holds; ``allocator``: the simulated
    CUDA allocator, whose calls so far are the timeline's prefix; ``mode``: the tracker's live-storage mode
    (its allocations and frees are the timeline's), set before entering. :meth:`observe` wraps the operator
    counter, which the tracker is given as its observer."""

    def __init__(self, regions: dict[str, nn.Module], allocator: CachingAllocatorModel | None = None,
                 model: nn.Module | None = None) -> None:
        self.regions, self.allocator, self.model = regions, allocator, model
        self.mode: Any = None
        self.timeline = Timeline()
        self.events = self.timeline.events
        self._uids: dict[int, int] = {}  # id(storage) -> uid, while it lives
        self._fresh: set[int] = set()  # uids made during the recording (not alive before it)
        self._next = 0
        self._packs = 0
        self._stack: list[int] = []
        self._calls: tuple[int, ...] = ()
        self._refs: dict[int, weakref.ref] = {}
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._unpacked = 0  # id of the storage the last unpack handed to autograd
        self._kept = frozenset(resolve_ops(DEFAULT_SAVE_OPS))  # what selective checkpointing keeps
        self._written: dict[Any, tuple[int, ...]] = {}  # op -> the positions of the arguments it writes

    # -- the tracker's allocations and frees --------------------------------------------------------------
    def alloc(self, key: int, nbytes: int, retroactive: bool, stream: Hashable = 0) -> None:
        self._next += 1
        self._uids[key] = self._next
        if stream != 0:
            self.timeline.streams[self._next] = stream
        if not retroactive:
            self._fresh.add(self._next)
        self.events.append((ALLOC, self._next, nbytes, retroactive))

    def free(self, key: int) -> None:
        uid = self._uids.pop(key, None)
        if uid is None:
            return
        # Frees with nothing between them (a structure torn down, a garbage collection) come in an order that follows
        # memory addresses, different every run: kept in the order the storages were made, so that a recording, and
        # the composed rows' simulated allocators, are the same every run.
        # (Not before the backward's return, where it came after it.)
        events, i, lo = self.events, len(self.events), self.timeline.step_at or 0
        while i > lo and events[i - 1][0] == FREE and events[i - 1][1] > uid:
            i -= 1
        events.insert(i, (FREE, uid))

    def rename(self, old: int, new: int) -> None:
        uid = self._uids.pop(old, None)
        if uid is not None:
            self._uids[new] = uid

    def gradient(self, key: int) -> None:
        """Storage ``key`` became a gradient (autograd accumulated it into a parameter's ``.grad``)."""
        uid = self._uids.get(key)
        if uid is not None:
            self.events.append((GRAD, uid))

    def scratch(self, sizes: tuple[int, ...]) -> None:
        """An operator's kernel scratch blocks (none, for a reduction that took none: its arguments, ``spec``,
        still let :mod:`memfit.planner.timeline_scale` work them out at another micro-batch)."""
        self.events.append((SCRATCH, tuple(sizes), getattr(sizes, "spec", None)))

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
        last = next((ev for ev in reversed(self.events) if ev[0] != SCRATCH), None)
        output = uid is not None and last is not None and last[0] == ALLOC and last[1] == uid
        self.events.append((PACK, hid, uid, self._calls, t.requires_grad, output))
        return saved

    def _dropped(self, hid: int) -> None:
        if self._hooks is not None:  # while recording
            self.events.append((DROP, hid))

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
        weakref.finalize(st, self._dropped, saved.hid)
        return t

    # -- region calls ----------------------------------------------------------------------------------------
    def _enter(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
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
        self.timeline.prefix = self.allocator.calls() if self.allocator is not None else None
        self.mode.timeline = self
        for name, module in self.regions.items():
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        if self.model is not None:
            self._handles += install_hooks(self.model, self.regions,
                                           lambda kind, ident: self.events.append((SYNC, kind, ident)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
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
        self.dropped: dict[int, int] = {}  # hid -> when what its last unpack handed backward died
        self.enter: dict[int, tuple[int, tuple[int, ...]]] = {}  # call -> index, input uids
        self.exit: dict[int, int] = {}
        self.packs: dict[int, list[int]] = {}  # call -> hids saved inside it
        self.allocs: list[tuple[int, int, int, bool]] = []  # (index, uid, nbytes, retroactive)
        self.scratch: list[tuple[int, tuple[int, ...]]] = []  # (index, sizes)
        self.grads: list[tuple[int, int]] = []  # (index, uid) where a storage became a gradient
        self.sync: list[tuple[int, int, Any]] = []  # (index, kind, identity) of the sync points
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
            elif kind == SCRATCH:
                self.scratch.append((i, ev[1]))
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
            elif kind == DROP:
                self.dropped[ev[1]] = i
            elif kind == GRAD:
                self.grads.append((i, ev[1]))
            elif kind == SYNC:
                self.sync.append((i, ev[1], ev[2]))
            elif kind == ENTER:
                self.enter[ev[1]] = (i, ev[2])
            elif kind == EXIT:
                self.exit[ev[1]] = i

    def release(self, hid: int) -> int:
        return self.released.get(hid, self.end)
