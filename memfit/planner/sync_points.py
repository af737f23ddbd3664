"""Where a sharded step's own buffers are, step by step: the tracked bytes at the same points of two recordings.

FSDP and ZeRO-2 hold buffers of their own beside a forward/backward's activations (gathered parameters, unsharded
gradients waiting for their reduce-scatter, its input and output), and they change where the sharded units'
hooks run: around each unit's forward and backward. A checkpointed step's peak falls elsewhere than the
reference step's (late in a unit's backward, during its recomputation), beside other buffers. So the planner
takes the sharding's bytes at each point of the step, not only at the reference's peak.

The points are module calls' hooks (the region calls' and those of every module holding parameters), the same in
every recording of one model: each call's forward begins and ends, and its backward begins (its outputs' gradients
are made) and ends (its inputs' are). A sharded full step records its tracked total at each point and its largest
total between them, each micro-step's where it accumulates (:class:`SyncRecorder`); a single-device recording has
the same points among its events (:mod:`memfit.planner.timeline`), which a composition turns into the same
figures, also as a later micro-step would hold them (:mod:`memfit.planner.recompute`).
:mod:`memfit.planner.sharded_peak` puts them together: a row's composed forward/backward plus, between each two
points, what the sharded step held there beyond the single-device reference step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

ENTER, EXIT, BACKWARD, BACKWARD_END = range(4)  # a call's forward begins, ends; its backward begins, ends
STEP = 4  # a recorded step's next micro-step begins (its model's forward is called again)
# A forward/backward's ``record`` (memfit.planner.fake.measure_step) that begins with this records its sync points
# only, not a timeline: a checkpointing choice run as it is (a model with its own checkpointing switch).
SYNC_ONLY = "sync points only"
# Where FSDP2's code is: an allocation or free made while one of its frames runs is the sharding's own.
_FSDP_DIR = os.path.join("torch", "distributed", "fsdp", "")


@dataclass(frozen=True)
class ShardTrace:
    """A recorded sharded step's simulated allocator calls (``CachingAllocatorModel.calls``, up to the end of its
    optimizer step, before any replay): its step began at ``trace[first]``; its forward/backward ran until
    ``trace[end]``; ``points``: the index of the next call at each sync point (of ``kinds``); ``own``: for each
    call of the forward/backward, whether the sharding's code made it (a frame of FSDP2's on the stack: its
    all-gathers, resharding, reduce-scatters and the gradients they free) rather than the model's operators."""

    trace: list[tuple[Any, int | None]]
    streams: dict[int, Any]
    first: int
    end: int
    points: tuple[int, ...]
    kinds: tuple[int, ...]
    own: bytes


@dataclass(frozen=True)
class SyncProfile:
    """Tracked bytes along one forward/backward: ``kinds`` of its points in order, ``start`` the total where it
    began, ``at`` the total at each point, ``peaks`` the largest total before the first point, between each two,
    and after the last (one more than the points); a recorded step's ``late``: for each of those stretches,
    whether its largest total came in the second half of its operators (a composition's: none); a composition's
    ``later``: the same forward/backward as a later micro-step of gradient accumulation on one device (the whole
    gradients held from its start, its own added into them); a recorded sharded step's ``own`` at each point and
    ``own_peaks`` between them: the bytes the sharding's code made and holds less those of the model's it freed
    (the gradients its reduce-scatters take), from where it began; ``ids``: each point's identity
    (:func:`install_hooks`), by which two steps whose backward reaches parallel branches in other orders pair their
    points."""

    kinds: tuple[int, ...]
    start: int
    at: tuple[int, ...]
    peaks: tuple[int, ...]
    late: tuple[bool, ...] = ()
    later: SyncProfile | None = None
    ids: tuple[Any, ...] = ()
    own: tuple[int, ...] = ()
    own_peaks: tuple[int, ...] = ()

    def shifted(self, nbytes: int) -> SyncProfile:
        """The same with ``nbytes`` more held throughout."""
        return SyncProfile(self.kinds, self.start + nbytes, tuple(a + nbytes for a in self.at),
                           tuple(p + nbytes for p in self.peaks), self.late,
                           self.later.shifted(nbytes) if self.later is not None else None, self.ids, self.own,
                           self.own_peaks)

    def micro_steps(self) -> list[SyncProfile]:
        """A recorded step's profile of each micro-step (split at its STEP points)."""
        cuts = [i for i, k in enumerate(self.kinds) if k == STEP]
        out, lo, start, own = [], 0, self.start, 0
        for hi in (*cuts, len(self.kinds)):
            out.append(SyncProfile(self.kinds[lo:hi], start, self.at[lo:hi], self.peaks[lo:hi + 1],
                                   self.late[lo:hi + 1], ids=self.ids[lo:hi],
                                   own=tuple(o - own for o in self.own[lo:hi]),
                                   own_peaks=tuple(o - own for o in self.own_peaks[lo:hi + 1])))
            if hi < len(self.kinds):
                lo, start, own = hi + 1, self.at[hi], self.own[hi] if self.own else 0
        return out


def later_profile(kinds: Sequence[int], start: int, at: Sequence[int], peaks: Sequence[int], grads: int,
                  ids: Sequence[Any] = ()) -> SyncProfile:
    """A forward/backward as a later micro-step of gradient accumulation holds it on one device, from its totals
    without the gradients it made (``start``, ``at``, ``peaks``) and their bytes when it ended (``grads``): the
    whole gradients held from its start, its own added into them."""
    return SyncProfile(tuple(kinds), start + grads, tuple(a + grads for a in at), tuple(p + grads for p in peaks),
                       ids=tuple(ids))


def install_hooks(model: nn.Module, regions: dict[str, nn.Module], point: Callable[[int, Any], None]) -> list[Any]:
    """Hooks that call ``point(kind, ident)`` at each point (see the module docstring) of ``regions`` and of
    ``model``'s modules that hold parameters (a point every few operators: a sharding's hooks run around those, and
    what they hold changes little between two points); their handles. ``ident``: the point's identity in any
    recording of the model, (kind, the module's place among those, its call since the hooks were installed, the
    tensor's place among its call's inputs or outputs). They hold no tensor and change no autograd graph (hooks on
    tensors that require grad)."""
    calls: dict[int, int] = {}

    def grads(kind: int, tensors: Any, call: tuple[int, int]) -> None:
        # One hook per tensor, its points in one order: a module's output is often the next one's input, and a
        # sharding's hooks may put a tensor of their own between the two (FSDP2 does, before each unit's input).
        for j, t in enumerate(_tensors(tensors)):
            if t.requires_grad and t.grad_fn is not None:
                kinds = getattr(t, "_memfit_sync_points", None)
                if kinds is None:
                    kinds = t._memfit_sync_points = []
                    t.register_hook(partial(_points, point, kinds))
                kinds.append((kind, *call, j))

    # A checkpointed call's forward runs again inside backward: not a point (a recording without checkpointing
    # has none there), and its outputs are not the ones backward goes through.
    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch._C._current_graph_task_id() == -1:
            call = (places[id(module)], calls.get(id(module), 0))
            calls[id(module)] = call[1] + 1
            point(ENTER, (ENTER, *call, 0))
            grads(BACKWARD_END, (args, kwargs), call)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() == -1:
            call = (places[id(module)], calls[id(module)] - 1)
            point(EXIT, (EXIT, *call, 0))
            grads(BACKWARD, output, call)

    handles = []
    ids = {id(m) for m in regions.values()}
    modules = [*regions.values(), *(m for m in model.modules() if id(m) not in ids and
                                     next(m.parameters(recurse=False), None) is not None)]
    places = {id(m): i for i, m in enumerate(modules)}
    for module in modules:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    return handles


def _points(point: Callable[[int, Any], None], idents: list[tuple[int, ...]], grad: Any) -> None:
    for ident in sorted(idents, key=lambda i: i[0], reverse=True):  # a later module's backward ends before an
        point(ident[0], ident)  # earlier one's begins


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class SyncRecorder:
    """Records a full step's :class:`SyncProfile` over its micro-steps' forward/backward, until its optimizer steps
    (a STEP point where a micro-step after the first begins). Given to the tracker's live storages as their
    ``timeline`` (it is told of each allocation); ``mode``: those live storages, set before entering."""

    def __init__(self, model: nn.Module, regions: dict[str, nn.Module]) -> None:
        self.model, self.regions = model, regions
        self.mode: Any = None
        self.kinds: list[int] = []
        self.ids: list[Any] = []
        self.start = 0
        self.at: list[int] = []
        self.peaks: list[int] = []
        self.late: list[bool] = []
        # The same without the gradients made so far: a later micro-step's, which holds the whole gradients instead
        self._start_ng = self._grads = 0
        self._at_ng: list[int] = []
        self._peaks_ng: list[int] = []
        self._ops = self._peak_op = 0  # operators in the current stretch; of them, where its peak was
        self._calls = 0  # of the model's forward
        self._handles: list[Any] = []
        self._open = False
        self._first = self._end = 0  # the allocator's calls where the step began, where its backward ended
        self._points: list[int] = []
        self._own = bytearray()  # of each allocator call since the step began: whether the sharding made it
        self._codes: dict[Any, bool] = {}  # code object -> whether it is FSDP2's
        # The sharding's own bytes (SyncProfile.own): the sizes of what the step made, which of them it made
        self._sizes: dict[int, int] = {}
        self._mine: set[int] = set()
        self._own_bytes = 0
        self.own: list[int] = []
        self.own_peaks: list[int] = [0]
        self.trace: ShardTrace | None = None

    def _tag(self, own: bool | None = None) -> None:
        """Tags the allocator calls made since the last tag: the sharding's where a frame of FSDP2's is running
        (``own``, where the caller knows)."""
        allocator = self.mode.allocator if self.mode is not None else None
        if allocator is None or not self._open:
            return
        n = len(allocator.trace) - self._first - len(self._own)
        if n > 0:
            self._own.extend((self._sharding() if own is None else own,) * n)

    def _sharding(self) -> bool:
        """Whether a frame of FSDP2's is running."""
        own, f, codes = False, sys._getframe(2), self._codes
        while f is not None and not own:
            code = f.f_code
            if code not in codes:
                codes[code] = _FSDP_DIR in code.co_filename
            own, f = codes[code], f.f_back
        return own

    def point(self, kind: int, ident: Any = None) -> None:
        if self._open:
            self._tag()
            if self.mode.allocator is not None:
                self._points.append(len(self.mode.allocator.trace))
            total = self.mode.total
            self._seen(total)
            self.late.append(2 * self._peak_op > self._ops)
            self.kinds.append(kind)
            self.ids.append((kind,) if ident is None else ident)
            self.at.append(total)
            self.peaks.append(total)
            without = total - self.mode.current["gradients"]
            self._at_ng.append(without)
            self._peaks_ng.append(without)
            self.own.append(self._own_bytes)
            self.own_peaks.append(self._own_bytes)
            self._ops = self._peak_op = 0

    def _seen(self, total: int) -> None:
        if not self._open:
            return
        if total > self.peaks[-1]:
            self.peaks[-1] = total
            self._peak_op = self._ops
        without = total - self.mode.current["gradients"]
        if without > self._peaks_ng[-1]:
            self._peaks_ng[-1] = without

    # -- the live storages' calls ---------------------------------------------------------------------------
    def alloc(self, key: int, nbytes: int, retroactive: bool, stream: Any = 0) -> None:
        own = self._open and self._sharding()
        self._tag(own)
        if self._open and retroactive:  # alive since before the step: at every point so far too
            self.start += nbytes
            self.at = [a + nbytes for a in self.at]
            self.peaks = [p + nbytes for p in self.peaks]
            self._start_ng += nbytes
            self._at_ng = [a + nbytes for a in self._at_ng]
            self._peaks_ng = [p + nbytes for p in self._peaks_ng]
        elif self._open:
            self._sizes[key] = nbytes
            if own:
                self._mine.add(key)
                self._own_bytes += nbytes
                if self._own_bytes > self.own_peaks[-1]:
                    self.own_peaks[-1] = self._own_bytes

    def free(self, key: int) -> None:
        own = self._open and self._sharding()
        self._tag(own)
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None and (key in self._mine or own):  # its own, or a gradient it took
            self._mine.discard(key)
            self._own_bytes -= nbytes

    def gradient(self, key: int) -> None:
        pass

    def rename(self, old: int, new: int) -> None:
        if old in self._sizes:
            self._sizes[new] = self._sizes.pop(old)
        if old in self._mine:
            self._mine.discard(old)
            self._mine.add(new)

    def scratch(self, sizes: tuple[int, ...]) -> None:
        self._tag()
        self._seen(self.mode.total + sum(sizes))  # blocks the operator just counted held beside its outputs

    def observe(self, counter: Any) -> Any:
        """``counter`` as an observer that also takes the total after each operator."""

        def observer(func: Any, args: Any, kwargs: Any, out: Any) -> None:
            counter(func, args, kwargs, out)
            self._ops += 1
            self._seen(self.mode.total)

        return observer

    def _micro_step(self, *args: Any) -> None:
        self._calls += 1
        if self._calls > 1:
            self.point(STEP)

    def _close(self, *args: Any) -> None:
        if self._open:
            self._tag()
            if self.mode.allocator is not None:
                self._end = len(self.mode.allocator.trace)
            self._seen(self.mode.total)
            self.late.append(2 * self._peak_op > self._ops)
            self._grads = self.mode.current["gradients"]
            self._open = False

    def __enter__(self) -> SyncRecorder:
        self._open = True
        self._first = len(self.mode.allocator.trace) if self.mode.allocator is not None else 0
        self.start = self.mode.total
        self.peaks = [self.start]
        self._start_ng = self.start - self.mode.current["gradients"]
        self._peaks_ng = [self._start_ng]
        self._grads = 0
        self.mode.timeline = self
        self._handles = install_hooks(self.model, self.regions, self.point)
        self._handles.append(register_optimizer_step_pre_hook(self._close))
        # Before the model's own point (a model holding parameters itself, DINO's level embedding, has one): a
        # micro-step's points all come after its STEP.
        self._handles.append(self.model.register_forward_pre_hook(self._micro_step, prepend=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close()
        for h in self._handles:
            h.remove()
        self.mode.timeline = None
        allocator = self.mode.allocator
        if allocator is not None and exc[0] is None:
            trace, streams = allocator.calls()
            self.trace = ShardTrace(trace, streams, self._first, self._end, tuple(self._points), tuple(self.kinds),
                                    bytes(self._own))

    @property
    def profile(self) -> SyncProfile:
        """The recorded profile; for a forward/backward (one micro-step), with ``later``: the same as a later
        micro-step of gradient accumulation would hold it (the gradients it made held from its start instead of as
        it makes them), as a composition's (:mod:`memfit.planner.recompute`)."""
        later = None
        if STEP not in self.kinds:
            later = later_profile(self.kinds, self._start_ng, self._at_ng, self._peaks_ng, self._grads, self.ids)
        return SyncProfile(tuple(self.kinds), self.start, tuple(self.at), tuple(self.peaks), tuple(self.late), later,
                           tuple(self.ids), tuple(self.own), tuple(self.own_peaks))
