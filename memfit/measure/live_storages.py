"""The live-storage tracker behind :class:`memfit.measure.tracker.MemoryTracker` on CPU, meta and fake
tensors: a ``TorchDispatchMode`` that keeps the running total and peak of live storage bytes by category
(the accounting is described in :mod:`memfit.measure.tracker`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure.caching_allocator import CachingAllocatorModel
from memfit.measure.gradient_sums import BlockKeys, fills_in_place, sums_gradients
from memfit.measure.storages import storages

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "communication", "inputs")
# Host memory a device step holds (an offloaded optimizer's copies and state): kept apart from the device's
# total and peak, in ``host`` and ``host_peak``.
HOST = "host"
# Collectives (eager c10d, functional collectives) and FSDP2's copy-in/copy-out ops around them.
_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "fsdp"})
# The labels a collective (or a resize) may override: the others say what a storage is more precisely.
_OVERRIDABLE = frozenset({"activations", "inputs"})
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_DEVICE = torch.ops.prim.device.default  # a fake tensor's .device: 2 in 3 of a fake step's calls, no memory


class LiveStorages(TorchDispatchMode):
    """Running total and peak of live storage bytes by category (the CPU/meta/fake backend)."""

    def __init__(self) -> None:
        super().__init__()
        # id(storage) -> [weakref, nbytes, category, serial]. Keyed by identity, not data_ptr: fake and
        # meta storages have no address, and torch keeps one Python object per storage alive as long as
        # the storage itself lives, so identity is stable. ``serial`` orders additions: a live storage
        # with serial <= ``peak_serial`` was alive at the peak.
        self.live: dict[int, list[Any]] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_breakdown = dict(self.current)
        # The peak of all but the gradients: what a later micro-step of gradient accumulation adds to the whole
        # gradients it finds (its own accumulate in place), wherever in its backward that is.
        self.peak_without_grads = 0
        # Of the gradients, FSDP's sharded ones (:meth:`mark_sharded`), which its CPU offload keeps on the host: their
        # bytes now and at the peak (its unsharded gradients, accumulated while sync is off, stay on the device).
        self.sharded: set[int] = set()
        self.sharded_grads = self.peak_sharded_grads = 0
        self.serial = 0
        self.peak_serial = 0
        self.host = 0
        self.host_peak = 0
        self.new_category = "activations"
        # Called (by the MemoryTracker) to relabel every gradient; due after a reduce-scatter.
        self.relabel_grads: Callable[[], None] | None = None
        self.grads_pending = False
        self._fake_on_entry: Any = None
        self._orig_resize: Any = None
        self._orig_propagate: Any = None
        self.metadata_only = 0  # > 0 while DTensor computes an output's shape on stand-in tensors
        # A gradient sum not yet counted: (its storage, the older gradient's key, category), until the next event
        # shows whether the older one was freed at once (summed in place) or not (memfit.measure.gradient_sums).
        self._pending: tuple[torch.UntypedStorage, int, str] | None = None
        self._keys = BlockKeys()  # the allocator's key of each storage's block
        self.observer: Callable[[Any, Any, Any, Any], None] | None = None  # sees every counted operator
        self.allocator: CachingAllocatorModel | None = None  # replays every allocation and free
        # The streams the allocator is told of: torch.cpu's default one is 0, the others 1, 2, ... as first used.
        self._streams: dict[Any, int] = {torch.cpu.current_stream(): 0}
        # Told of every allocation and free, in order (the planner's recorded timeline, memfit.planner.timeline).
        self.timeline: Any = None
        self.stand_ins: set[int] = set()  # ids of storages that are not the step's memory (the timeline's)
        # A CUDA target's kernel scratch: the bytes of the blocks an operator takes while it runs (e.g.
        # memfit.planner.kernel_scratch.cuda_scratch), counted as activations from its outputs until it returns.
        self.scratch: Callable[[Any, Any, Any, Any], tuple[int, ...]] | None = None
        # The stream the step's inputs were allocated on (a CUDA target's: the Runner's copy stream), if not
        # the current one.
        self.input_stream: Hashable | None = None

    # -- bookkeeping ------------------------------------------------------------------------------
    def add(self, st: torch.UntypedStorage, category: str, retroactive: bool = False) -> None:
        """Count ``st`` under ``category``; a storage seen before only has its size re-read."""
        self._settle()
        key = id(st)
        entry = self.live.get(key)
        if entry is not None:
            n = st.nbytes()
            if entry[2] == HOST:
                self.host += n - entry[1]
                entry[1] = n
                self.host_peak = max(self.host_peak, self.host)
            elif n != entry[1]:  # resized in place (aten.resize_, storage.resize_)
                self.sharded_grads += n - entry[1] if key in self.sharded else 0
                self.current[entry[2]] += n - entry[1]
                self.total += n - entry[1]
                entry[1] = n
                if self.allocator is not None:  # another block (FSDP2 resizes between 0 and full size)
                    self._keys.free(self.allocator, key)
                    self._keys.malloc(self.allocator, key, n, self.stream())
                if self.timeline is not None:
                    self.timeline.free(key)
                    self.timeline.alloc(key, n, False, self.stream())
            return
        n = st.nbytes()
        ref = weakref.ref(st, lambda r, key=key: self._free(key, r))
        self.serial += 1
        self.live[key] = [ref, n, category, 0 if retroactive else self.serial]
        if category == HOST:
            self.host += n
            self.host_peak = max(self.host_peak, self.host)
            return
        stream = self.input_stream if category == "inputs" and self.input_stream is not None else self.stream()
        if self.allocator is not None:
            self._keys.malloc(self.allocator, key, n, stream)
        if self.timeline is not None:
            self.timeline.alloc(key, n, retroactive, stream)
        self.current[category] += n
        self.total += n
        if retroactive:  # alive since before entry: every earlier moment, the peak included, held it
            self.peak += n
            self.peak_breakdown[category] += n
            self.peak_without_grads += n if category != "gradients" else 0

    def hold(self, key: Hashable, nbytes: int, category: str, stream: Hashable) -> None:
        """``nbytes`` held from now to the end, which no tensor of the step shows (a CUDA target's next batch)."""
        self._settle()
        self.current[category] += nbytes
        self.total += nbytes
        self.update_peak()
        if self.allocator is not None:
            self.allocator.malloc(key, nbytes, stream)

    def stream(self) -> int:
        """The stream an allocation made now is on, as the simulated allocator keys it. On CPU, FSDP2's
        ``device_handle.stream(s)`` blocks (its reduce-scatter output, its all-gather buffers at N > 1) select
        torch.cpu's stand-in streams as they select CUDA's on a GPU, so the current one is CUDA's."""
        return self._streams.setdefault(torch.cpu.current_stream(), len(self._streams))

    def relabel(self, st: torch.UntypedStorage, category: str, only_from: frozenset[str] | None = None,
                retroactive: bool = False) -> None:
        """Count ``st`` under ``category`` from now on; ``retroactive``: at the peak too if it was alive then
        (what the storage already was, learnt late). ``only_from`` limits which labels are overridden."""
        entry = self.live.get(id(st))
        if entry is None:
            self.add(st, category)
        if category == "gradients" and self.timeline is not None:
            self.timeline.gradient(id(st))
        if entry is None:
            return
        old = entry[2]
        if old == category or (only_from is not None and old not in only_from) or old == HOST:
            return
        self._unshard(id(st), entry[1])  # gradients no more
        if category == HOST:
            self._to_host(st, entry, retroactive)
            return
        self.current[old] -= entry[1]
        self.current[category] += entry[1]
        entry[2] = category
        if retroactive and entry[3] <= self.peak_serial:
            # Clamped: a storage resized since the peak held other bytes then.
            moved = min(entry[1], self.peak_breakdown[old])
            self.peak_breakdown[old] -= moved
            self.peak_breakdown[category] += moved

    def _unshard(self, key: int, nbytes: int) -> None:
        """The storage ``key`` (of ``nbytes``) holds sharded gradients no more (freed, or counted otherwise)."""
        if key in self.sharded:
            self.sharded.discard(key)
            self.sharded_grads -= nbytes

    def mark_sharded(self, st: torch.UntypedStorage, retroactive: bool = False) -> None:
        """``st``, counted as gradients, holds sharded gradients (FSDP's, on the host under its CPU offload);
        ``retroactive``: also at the peak if it was alive then."""
        entry = self.live.get(id(st))
        if entry is None or entry[2] != "gradients" or id(st) in self.sharded:
            return
        self.sharded.add(id(st))
        self.sharded_grads += entry[1]
        if retroactive and entry[3] <= self.peak_serial:
            self.peak_sharded_grads = min(self.peak_sharded_grads + entry[1], self.peak_breakdown["gradients"])

    def _to_host(self, st: torch.UntypedStorage, entry: list[Any], retroactive: bool) -> None:
        """A storage counted on the device turns out to be host memory: out of the device's figures."""
        key, n, old = id(st), entry[1], entry[2]
        self.current[old] -= n
        self.total -= n
        if retroactive and entry[3] <= self.peak_serial:
            moved = min(n, self.peak_breakdown[old])
            self.peak_breakdown[old] -= moved
            self.peak -= moved
        if self.allocator is not None:
            self._keys.free(self.allocator, key)
        if self.timeline is not None:
            self.timeline.free(key)
        entry[2] = HOST
        self.host += n
        self.host_peak = max(self.host_peak, self.host)

    def _settle(self) -> None:
        """Any event but the older gradient's free settles a pending sum as a new storage."""
        if self._pending is not None:
            self._count_sum()

    def _count_sum(self, in_place_of: list | None = None) -> None:
        """Count the pending gradient sum: a new storage, or (``in_place_of``: the older gradient's entry, just
        freed) the older one's bytes and allocator block, as a real tensor's in-place sum would have kept them."""
        st, old_key, category = self._pending
        self._pending = None
        if in_place_of is None:
            self.add(st, category)
            self.update_peak()
            return
        key, n = id(st), in_place_of[1]
        self.live[key] = [weakref.ref(st, lambda r, key=key: self._free(key, r)), n, category, in_place_of[3]]
        self.current[category] += n
        self.total += n
        self._keys.take_over(key, old_key)
        if self.timeline is not None:
            self.timeline.rename(old_key, key)

    def _free(self, key: int, ref: weakref.ref) -> None:
        """A storage died: freed, unless it is the older gradient a pending sum was added into (then the sum takes
        its block)."""
        if self._pending is None:
            self._drop(key, ref)
        elif self._pending[1] != key:
            self._count_sum()
            self._drop(key, ref)
        else:
            entry = self.live.get(key)
            if entry is None or entry[0] is not ref:
                self._count_sum()
                return
            self._drop(key, ref, keep_block=True)
            self._count_sum(in_place_of=entry)

    def _drop(self, key: int, ref: weakref.ref, keep_block: bool = False) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[0] is ref and entry[2] == HOST:
            del self.live[key]
            self.host -= entry[1]
        elif entry is not None and entry[0] is ref:
            del self.live[key]
            self._unshard(key, entry[1])
            if self.allocator is not None and not keep_block:
                self._keys.free(self.allocator, key)
            if self.timeline is not None and not keep_block:
                self.timeline.free(key)
            self.current[entry[2]] -= entry[1]
            self.total -= entry[1]

    def _kernel_scratch(self, sizes: tuple[int, ...]) -> None:
        """Blocks an operator holds while it runs, after its outputs: allocated in order, freed in reverse."""
        if not sizes:
            if self.timeline is not None and getattr(sizes, "spec", None) is not None:
                self.timeline.scratch(sizes)  # a reduction that takes none here may at another micro-batch
            return
        self._settle()
        keys = [("scratch", self.serial, i) for i in range(len(sizes))]
        if self.allocator is not None:
            for key, n in zip(keys, sizes):
                self.allocator.malloc(key, n, self.stream())
        held = sum(sizes)
        self.current["activations"] += held
        self.total += held
        self.update_peak()
        self.current["activations"] -= held
        self.total -= held
        if self.allocator is not None:
            for key in reversed(keys):
                self.allocator.free(key)
        if self.timeline is not None:
            self.timeline.scratch(sizes)

    def update_peak(self) -> None:
        self.peak_without_grads = max(self.peak_without_grads, self.total - self.current["gradients"])
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.current)
            self.peak_serial = self.serial
            self.peak_sharded_grads = self.sharded_grads

    def _communication(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for st in storages:
            if id(st) in self.live:
                self.relabel(st, "communication", only_from=_OVERRIDABLE, retroactive=True)
            else:  # first seen by a collective: a buffer allocated before the step (DDP's buckets)
                self.add(st, "communication", retroactive=True)

    # -- mode ---------------------------------------------------------------------------------------
    def __enter__(self) -> LiveStorages:
        self._fake_on_entry = active_fake_mode()
        self.host_peak = self.host
        self.peak = self.total
        self.peak_breakdown = dict(self.current)
        self.peak_serial = self.serial
        self.peak_sharded_grads = self.sharded_grads
        self.peak_without_grads = self.total - self.current["gradients"]
        # Storage.resize_ bypasses the dispatcher (FSDP2 allocates and frees its unsharded parameters
        # with it); torch's MemTracker patches it the same way.
        self._orig_resize = orig = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            if id(st) not in self.live:  # its bytes before the resize (FSDP2: none) were held all along
                self.add(st, "communication", retroactive=True)
            out = orig(st, size)
            self.add(st, "communication")  # re-reads the size
            self.relabel(st, "communication", only_from=_OVERRIDABLE, retroactive=True)
            self.update_peak()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        if _ShardingPropagator is not None:
            # The first time DTensor meets an op it runs it on stand-ins of its global shape, in the active
            # fake mode (ours, under the planner), to learn the output's shape: no memory of the step.
            self._orig_propagate = propagate = _ShardingPropagator._propagate_tensor_meta_non_cached

            def shapes_only(prop: Any, *args: Any, **kwargs: Any) -> Any:
                self.metadata_only += 1
                try:
                    return propagate(prop, *args, **kwargs)
                finally:
                    self.metadata_only -= 1

            _ShardingPropagator._propagate_tensor_meta_non_cached = shapes_only
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._settle()
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._orig_propagate is not None:
            _ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        super().__exit__(*exc)
        # Dropping the weak references drops their finalisers: nothing calls back into a closed tracker.
        self.live.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and type(args[0]) is FakeTensor:  # FakeTensor's own answer, without a second dispatch
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        if _DTensor is not None and any(t is _DTensor for t in types):
            return NotImplemented  # let DTensor desugar to local tensors, which are what holds memory
        if self.metadata_only or func is _DEVICE:
            return func(*args, **(kwargs or {}))
        comm = func.namespace in _COMM_NAMESPACES
        # ``torch.tensor(...)`` made inside the step (Adam's first ``step`` counters) reaches the mode as
        # lift_fresh of a constant made outside the dispatcher: it is new, not an input alive at entry.
        # A nested fake mode (DTensor sharding propagation) computes metadata only: its tensors are not memory.
        own = active_fake_mode() is self._fake_on_entry
        inputs = storages((args, kwargs)) if own and func is not _LIFT_FRESH else ()
        if comm:
            self._before_collective(func, args)
            self._communication(inputs)
        else:
            for st in inputs:
                if id(st) not in self.live and id(st) not in self.stand_ins:
                    self.add(st, "inputs", retroactive=True)
        out = func(*args, **(kwargs or {}))
        if own and self.observer is not None:
            self.observer(func, args, kwargs, out)
        if own:
            if comm:
                self._communication(storages(out))
            elif sums_gradients(func, args, kwargs, out, self.live) or fills_in_place(func, args, out, self.live):
                self._pending = (out.untyped_storage(), id(args[0].untyped_storage()), self.new_category)
            else:
                for st in storages(out):
                    if id(st) not in self.stand_ins:
                        self.add(st, self.new_category)
            self.update_peak()
            if self.scratch is not None and not comm:
                self._kernel_scratch(self.scratch(func, args, kwargs, out))
        if comm and "reduce_scatter" in func.__name__:
            self.grads_pending = True
        return out

    def _before_collective(self, func: Any, args: Any) -> None:
        """Gradients are found at collectives, not at every op (that would cost O(parameters) per op).
        The walk a reduce-scatter makes due waits for the next collective: the ops right after it
        (views of its output, dtype casts) run before FSDP2 assigns the sharded gradients, and a walk
        later than the peak still corrects it (``relabel``)."""
        if self.grads_pending and self.relabel_grads is not None:
            self.relabel_grads()
        if func.namespace == "fsdp" and func.__name__.startswith("chunk_cat"):
            # FSDP2 packs the unsharded gradients autograd computed into the reduce-scatter input.
            for st in storages(args[0]):
                self.relabel(st, "gradients", only_from=_OVERRIDABLE, retroactive=True)


try:
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator as _ShardingPropagator
except ImportError:  # torch built without distributed
    _DTensor = _ShardingPropagator = None
