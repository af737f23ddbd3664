"""Peak memory of a training step, with a breakdown into parameters, gradients, optimizer state
and activations — on CUDA from the caching allocator, everywhere else from live tensor storages.

Usage::

    with MemoryTracker(model, optimizer) as t:
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(t.peak_bytes, t.breakdown)
    print(t.report())

**CPU, meta and fake tensors** (``FakeTensorMode``): a ``TorchDispatchMode`` sees the output of
every operator. Each new storage is recorded once (views share their storage, so they are not
counted twice) with a weak reference whose finaliser subtracts its bytes when the storage is freed;
the running total's maximum is the peak. Storages alive at entry (parameters, buffers, gradients,
optimizer state) are counted from the start; any other storage first seen as an operator *input*
(the batch, a cached tensor) was alive before the step began, so it is added to the peak
retroactively under ``inputs``. This is the same accounting as torch's
``torch.distributed._tools.mem_tracker.MemTracker`` (tests check the peaks are equal to the byte)
at a fraction of its cost, because it keeps no per-module snapshots. It does not see allocator
rounding, kernel workspaces, or tensors created and freed entirely outside the dispatcher, and it
slows each step by the Python call per operator (a few times slower on small CPU ops).

**CUDA**: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` is the peak (exact,
cheap). The breakdown is an approximation: parameters, buffers and optimizer state are measured at
exit (they do not shrink during a step), gradients are every distinct gradient storage produced
during backward (assumed alive together at the peak), and activations are the rest of the peak
(activations, temporaries, inputs and allocator rounding).

Categories: ``parameters`` (``model.parameters()``), ``buffers`` (``model.buffers()``),
``gradients`` (``p.grad`` storages, relabelled by a post-accumulate-grad hook when backward
produces them), ``optimizer_state`` (tensors in ``optimizer.state`` plus the optimizer's own
temporaries during ``step()``, as MemTracker counts them), ``activations`` (everything else created
during the step) and ``inputs`` (tensors alive at entry that are none of the above).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "inputs")
MB = 2**20  # "MB" in reports means MiB, as in MMEngine's and the seeds' memory logs


def _storages(obj: Any) -> Iterable[torch.UntypedStorage]:
    """The untyped storages behind every tensor in a (nested) structure; wrapper subclasses unwrapped."""
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided:
            yield from get_untyped_storages(leaf)


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class _LiveStorages(TorchDispatchMode):
    """Running total and peak of live storage bytes by category (the CPU/meta/fake backend)."""

    def __init__(self) -> None:
        super().__init__()
        # id(storage) -> [weakref, nbytes, category]. Keyed by identity, not data_ptr: fake and meta
        # storages have no address, and torch keeps one Python object per storage alive as long as
        # the storage itself lives, so identity is stable.
        self.live: dict[int, list[Any]] = {}
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_breakdown = dict(self.current)
        self.new_category = "activations"
        self._fake_on_entry: Any = None
        self._orig_resize: Any = None

    # -- bookkeeping ------------------------------------------------------------------------------
    def add(self, st: torch.UntypedStorage, category: str, retroactive: bool = False) -> None:
        """Count ``st`` under ``category``; a storage seen before only has its size re-read."""
        key = id(st)
        entry = self.live.get(key)
        if entry is not None:
            n = st.nbytes()
            if n != entry[1]:  # resized in place (aten.resize_, storage.resize_)
                self.current[entry[2]] += n - entry[1]
                self.total += n - entry[1]
                entry[1] = n
            return
        n = st.nbytes()
        ref = weakref.ref(st, lambda r, key=key: self._free(key, r))
        self.live[key] = [ref, n, category]
        self.current[category] += n
        self.total += n
        if retroactive:  # alive since before entry: every earlier moment, the peak included, held it
            self.peak += n
            self.peak_breakdown[category] += n

    def relabel(self, st: torch.UntypedStorage, category: str) -> None:
        entry = self.live.get(id(st))
        if entry is None:
            self.add(st, category)
        elif entry[2] != category:
            self.current[entry[2]] -= entry[1]
            self.current[category] += entry[1]
            entry[2] = category

    def _free(self, key: int, ref: weakref.ref) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[0] is ref:
            del self.live[key]
            self.current[entry[2]] -= entry[1]
            self.total -= entry[1]

    def update_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.current)

    # -- mode ---------------------------------------------------------------------------------------
    def __enter__(self) -> _LiveStorages:
        self._fake_on_entry = active_fake_mode()
        self.peak = self.total
        self.peak_breakdown = dict(self.current)
        # Storage.resize_ bypasses the dispatcher (FSDP frees unsharded parameters with it); torch's
        # MemTracker patches it the same way.
        self._orig_resize = orig = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            if id(st) in self.live:
                self.add(st, "activations")
                self.update_peak()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)
        # Dropping the weak references drops their finalisers: nothing calls back into a closed tracker.
        self.live.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _DTensor is not None and any(t is _DTensor for t in types):
            return NotImplemented  # let DTensor desugar to local tensors, which are what holds memory
        for st in _storages((args, kwargs)):
            if id(st) not in self.live:
                self.add(st, "inputs", retroactive=True)
        out = func(*args, **(kwargs or {}))
        # A nested fake mode (DTensor sharding propagation) computes metadata only: not memory.
        if active_fake_mode() is self._fake_on_entry:
            for st in _storages(out):
                self.add(st, self.new_category)
            self.update_peak()
        return out


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None


class MemoryTracker:
    """Context manager measuring the peak memory of the code it wraps, with a breakdown at the peak.

    ``model`` and ``optimizer`` let the tracker label parameters, buffers, gradients and optimizer
    state; without them everything counts as activations or inputs. ``device`` defaults to the
    model's parameter device (else CPU); CUDA uses the allocator's peak, any other device (CPU,
    meta, fake tensors under ``FakeTensorMode``) the live-storage tracker described in the module
    docstring. After the block: ``peak_bytes``, ``breakdown`` (bytes per category at the peak,
    summing to ``peak_bytes``) and ``report()``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._mode: _LiveStorages | None = None
        self._handles: list[Any] = []
        self._grad_bytes: dict[int, int] = {}

    @property
    def uses_allocator(self) -> bool:
        return self.device.type == "cuda"

    def _params(self) -> list[nn.Parameter]:
        return list(self.model.parameters()) if self.model is not None else []

    def __enter__(self) -> MemoryTracker:
        self._grad_bytes = {}
        for p in self._params():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.uses_allocator:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        mode = self._mode = _LiveStorages()
        if self.model is not None:
            for st in _storages(self._params()):
                mode.add(st, "parameters")
            for st in _storages(list(self.model.buffers())):
                mode.add(st, "buffers")
            for st in _storages([p.grad for p in self._params()]):
                mode.add(st, "gradients")
        for st in _storages(_optimizer_state_tensors(self.optimizer)):
            mode.add(st, "optimizer_state")
        # Global hooks, as MemTracker's: every optimizer's step (also per-parameter optimizers that
        # step inside backward) labels what it allocates as optimizer memory.
        self._handles.append(register_optimizer_step_pre_hook(self._on_step_begin))
        self._handles.append(register_optimizer_step_post_hook(self._on_step_end))
        mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.uses_allocator:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.breakdown = self._allocator_breakdown()
            return
        mode = self._mode
        assert mode is not None
        self.peak_bytes = mode.peak
        self.breakdown = dict(mode.peak_breakdown)
        mode.__exit__(*exc)
        self._mode = None

    # -- hooks --------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        for st in _storages(p.grad):
            self._grad_bytes[id(st)] = st.nbytes()
            if self._mode is not None:
                self._mode.relabel(st, "gradients")
                self._mode.update_peak()

    def _on_step_begin(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mode is not None:
            self._mode.new_category = "optimizer_state"

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mode is not None:
            self._mode.new_category = "activations"
            for st in _storages(_optimizer_state_tensors(optimizer)):
                self._mode.relabel(st, "optimizer_state")

    def _allocator_breakdown(self) -> dict[str, int]:
        def nbytes(tensors: Iterable[Any]) -> int:
            return sum({id(st): st.nbytes() for st in _storages(list(tensors))}.values())

        params = self._params()
        out = dict.fromkeys(CATEGORIES, 0)
        out["parameters"] = nbytes(params)
        out["buffers"] = nbytes(self.model.buffers()) if self.model is not None else 0
        out["gradients"] = max(sum(self._grad_bytes.values()), nbytes(p.grad for p in params))
        out["optimizer_state"] = nbytes(_optimizer_state_tensors(self.optimizer))
        out["activations"] = max(0, self.peak_bytes - sum(out.values()))
        return out

    # -- output -------------------------------------------------------------------------------------
    def report(self) -> str:
        """The breakdown at the peak as a small table in MB (2**20 bytes)."""
        width = max(len(c) for c in CATEGORIES) + 2
        lines = [f"{'memory at peak':<{width}}{'MB':>10}"]
        lines += [f"{c:<{width}}{self.breakdown.get(c, 0) / MB:>10.1f}" for c in CATEGORIES]
        lines.append(f"{'peak':<{width}}{self.peak_bytes / MB:>10.1f}")
        how = "allocator" if self.uses_allocator else "live tensor storages"
        lines.append(f"(device {self.device}, measured from {how})")
        return "\n".join(lines)
