"""Peak memory of a training step, with a breakdown into parameters, gradients, optimizer state,
activations and communication buffers — on CUDA from the caching allocator, everywhere else from
live tensor storages.

Usage::

    with MemoryTracker(model, optimizer) as t:
        loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(t.peak_bytes, t.breakdown)
    print(t.report())

**CPU, meta and fake tensors** (``FakeTensorMode``, also with a fake process group): a
``TorchDispatchMode`` sees the output of every operator. Each new storage is recorded once (views
share their storage, so they are not counted twice) with a weak reference whose finaliser subtracts
its bytes when the storage is freed; the running total's maximum is the peak. Storages alive at
entry (parameters, buffers, gradients, optimizer state) are counted from the start; any other
storage first seen as an operator *input* (the batch, a cached tensor) was alive before the step
began, so it is added to the peak retroactively under ``inputs`` (``communication`` when a
collective sees it first). This is the same accounting as torch's
``torch.distributed._tools.mem_tracker.MemTracker`` and, under FSDP2, ``FSDPMemTracker`` (tests
check the peaks are equal to the byte) at a fraction of their cost, because it keeps no per-module
snapshots. It does not see allocator rounding, kernel workspaces, or tensors created and freed
entirely outside the dispatcher, and it slows each step by the Python call per operator (a few times
slower on small CPU ops).

**CUDA**: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` is the peak (exact,
cheap). The breakdown is an approximation: parameters, buffers and optimizer state (master weights
included) are measured at exit (they do not shrink during a step), gradients are every distinct
gradient storage produced during backward (assumed alive together at the peak), and activations are
the rest of the peak (activations, temporaries, communication buffers, inputs and allocator
rounding); ``communication`` stays 0.

Categories:

* ``parameters``: ``model.parameters()`` at entry (FSDP2's sharded parameters);
* ``buffers``: ``model.buffers()``;
* ``gradients``: ``.grad`` storages, relabelled by a post-accumulate-grad hook when backward produces
  them, and by a walk over every gradient after each reduce-scatter (at the next collective), when
  an optimizer step begins and at exit: FSDP2 assigns sharded gradients and O2 the fp32 masters'
  gradients directly. FSDP2's unsharded gradients count too: those ``fsdp::chunk_cat`` packs for the
  reduce-scatter and those kept while gradient sync is off;
* ``optimizer_state``: tensors in ``optimizer.state``, the optimizer's own temporaries during
  ``step()`` (as MemTracker counts them), and the parameters the optimizer steps that are not the
  model's: Apex O2/O3's fp32 master weights, which ZeRO too counts as optimizer state;
* ``activations``: everything else created during the step;
* ``communication``: every storage a collective touches (inputs and outputs of ``c10d`` and
  ``_c10d_functional`` ops and of FSDP2's ``fsdp::`` copy ops: all-gather and reduce-scatter
  buffers, DDP's buckets, found at their first all-reduce) and every storage
  ``UntypedStorage.resize_`` grows (FSDP2's unsharded parameters). A storage already labelled a
  parameter, buffer, gradient or optimizer state keeps its label;
* ``inputs``: tensors alive at entry that are none of the above.

Host memory is not the device's: an offloaded optimizer's (:mod:`memfit.optim.offload`) parameter
copies, state and everything its step allocates are counted apart, in ``host_peak_bytes``, on every
device (on a CPU run host and device are one memory, and ``peak_bytes`` is then what a GPU would hold).

A label found late says what a storage already was (a bucket's first all-reduce, a gradient assigned
outside autograd): relabelling a storage alive at the peak then moves its bytes in the peak
breakdown too. The post-accumulate-grad hook does not: the storage becomes a gradient at that moment
(MemTracker's accounting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memfit.measure.caching_allocator import CachingAllocatorModel
from memfit.measure.live_storages import CATEGORIES, HOST, LiveStorages
from memfit.measure.storages import (
    fsdp_params,
    host_tensors,
    is_host_resident,
    optimizer_state_tensors,
    stepped_params,
    storages,
)

MB = 2**20  # "MB" in reports means MiB, as in MMEngine's memory logs (its large-model training guide's too)


class MemoryTracker:
    """Context manager measuring the peak memory of the code it wraps, with a breakdown at the peak.

    ``model`` and ``optimizer`` let the tracker label parameters, buffers, gradients and optimizer
    state; without them everything counts as activations, communication or inputs. ``device``
    defaults to the model's parameter device (else CPU); CUDA uses the allocator's peak, any other
    device (CPU, meta, fake tensors under ``FakeTensorMode``) the live-storage tracker described in
    the module docstring; there ``observer(func, args, kwargs, out)`` is called for every operator it
    counts (the planner counts FLOPs with it), and ``allocator`` replays every allocation and free.
    After the block: ``peak_bytes``, ``breakdown`` (per category at the peak) and ``report()``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | str | None = None,
        observer: Callable[[Any, Any, Any, Any], None] | None = None,
        allocator: CachingAllocatorModel | None = None,
    ) -> None:
        self.model = model
        self.observer = observer
        self.allocator = allocator
        # ZeRO-1's ZeroRedundancyOptimizer steps a local optimizer over this rank's shard, which holds the state.
        self.optimizer = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.host_peak_bytes = 0  # host memory of an offloaded optimizer (live-storage tracker), not in peak_bytes
        self.breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._mode: LiveStorages | None = None
        self._handles: list[Any] = []
        self._grad_bytes: dict[int, int] = {}
        # Read once at entry: the walks after each reduce-scatter must stay O(parameters). FSDP2 swaps
        # the registered parameters for unsharded ones inside forward and backward; these are the sharded
        # ones, which the optimizer steps and which hold the gradients.
        self._param_list: list[nn.Parameter] = []
        self._param_ids: set[int] = set()
        self._fsdp: list[Any] = []

    @property
    def live_storages(self) -> LiveStorages | None:
        """The live-storage dispatch mode while the CPU/fake tracker is inside its block (else None)."""
        return self._mode

    @property
    def uses_allocator(self) -> bool:
        return self.device.type == "cuda"

    def _params(self) -> list[nn.Parameter]:
        return list(self.model.parameters()) if self.model is not None else []

    def _grads(self, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor | None]:
        """Every gradient the step holds: the model's parameters', the stepped parameters' (O2's fp32
        masters are assigned theirs directly) and FSDP2's unsharded ones (kept while sync is off)."""
        grads = [p.grad for p in self._param_list]
        grads += [p.grad for p in stepped_params(optimizer or self.optimizer) if id(p) not in self._param_ids]
        for fsdp_param in self._fsdp:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            grads += [getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)]
        return grads

    def _copies(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        """What the optimizer steps in place of the model's parameters (fp32 master weights)."""
        if self.model is None:
            return []  # without the model, parameters cannot be told from copies
        return [p for p in stepped_params(optimizer) if id(p) not in self._param_ids]

    def __enter__(self) -> MemoryTracker:
        self._grad_bytes = {}
        self._param_list = self._params()
        self._param_ids = {id(p) for p in self._param_list}
        self._fsdp = fsdp_params(self.model)
        for p in self._param_list:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.uses_allocator:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        mode = self._mode = LiveStorages()
        mode.allocator = self.allocator
        for st in storages(host_tensors(self.optimizer)):
            mode.add(st, HOST)
        if self.model is not None:
            for st in storages(self._param_list):
                mode.add(st, "parameters")
            for st in storages(list(self.model.buffers())):
                mode.add(st, "buffers")
        for st in storages(self._grads()):
            mode.add(st, "gradients")
        for st in storages(optimizer_state_tensors(self.optimizer) + self._copies(self.optimizer)):
            mode.add(st, "optimizer_state")
        mode.relabel_grads = self._relabel_grads
        mode.observer = self.observer
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
        self._relabel_grads()  # gradients assigned since the last walk, also in the peak breakdown
        self.peak_bytes = mode.peak
        self.host_peak_bytes = mode.host_peak
        self.breakdown = dict(mode.peak_breakdown)
        mode.__exit__(*exc)
        self._mode = None

    # -- hooks --------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        for st in storages(p.grad):
            self._grad_bytes[id(st)] = st.nbytes()
            if self._mode is not None:
                self._mode.relabel(st, "gradients")
                self._mode.update_peak()

    def _relabel_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self._mode is not None:
            self._mode.grads_pending = False
            for st in storages(self._grads(optimizer)):
                self._mode.relabel(st, "gradients", retroactive=True)
            if self._fsdp:  # the registered parameters' gradients are FSDP's sharded ones
                for st in storages([p.grad for p in self._param_list]):
                    self._mode.mark_sharded(st, retroactive=True)
            self._mode.update_peak()

    def _on_step_begin(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mode is not None and is_host_resident(optimizer):
            if hasattr(optimizer, "host_optimizer"):  # the device side: its gradients are the model's
                self._relabel_grads(optimizer)
            self._mode.new_category = HOST
        elif self._mode is not None:
            self._relabel_grads(optimizer)
            for st in storages(self._copies(optimizer)):
                self._mode.relabel(st, "optimizer_state", retroactive=True)
            self._mode.new_category = "optimizer_state"

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._mode is not None:
            self._mode.new_category = "activations"
            for st in storages(optimizer_state_tensors(optimizer)):
                self._mode.relabel(st, "optimizer_state")
            for st in storages(host_tensors(optimizer)):
                self._mode.relabel(st, HOST)

    def _allocator_breakdown(self) -> dict[str, int]:
        def nbytes(tensors: Iterable[Any]) -> int:
            return sum({id(st): st.nbytes() for st in storages(list(tensors))}.values())

        out = dict.fromkeys(CATEGORIES, 0)
        out["parameters"] = nbytes(self._param_list)
        out["buffers"] = nbytes(self.model.buffers()) if self.model is not None else 0
        out["gradients"] = max(sum(self._grad_bytes.values()), nbytes(self._grads()))
        out["optimizer_state"] = nbytes(optimizer_state_tensors(self.optimizer) + self._copies(self.optimizer))
        out["activations"] = max(0, self.peak_bytes - sum(out.values()))
        return out

    # -- output -------------------------------------------------------------------------------------
    def peak_so_far(self) -> tuple[int, dict[str, int], int]:
        """(peak bytes, breakdown at that peak, FSDP's sharded gradients of its gradients) since entry or the last
        :meth:`reset_peak`, inside the block (live-storage tracker only): how the planner splits a step into phases."""
        mode = self._mode
        assert mode is not None, "peak_so_far() is for the CPU/fake tracker, inside the with block"
        return mode.peak, dict(mode.peak_breakdown), mode.peak_sharded_grads

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now (``torch.cuda.reset_peak_memory_stats``'s twin)."""
        mode = self._mode
        assert mode is not None, "reset_peak() is for the CPU/fake tracker, inside the with block"
        mode.peak, mode.peak_breakdown, mode.peak_sharded_grads = mode.total, dict(mode.current), mode.sharded_grads

    def report(self) -> str:
        """The breakdown at the peak as a small table in MB (2**20 bytes)."""
        width = max(len(c) for c in CATEGORIES) + 2
        lines = [f"{'memory at peak':<{width}}{'MB':>10}"]
        lines += [f"{c:<{width}}{self.breakdown.get(c, 0) / MB:>10.1f}" for c in CATEGORIES]
        lines.append(f"{'peak':<{width}}{self.peak_bytes / MB:>10.1f}")
        if self.host_peak_bytes:
            lines.append(f"{'host (offloaded)':<{width}}{self.host_peak_bytes / MB:>10.1f}")
        how = "allocator" if self.uses_allocator else "live tensor storages"
        lines.append(f"(device {self.device}, measured from {how})")
        return "\n".join(lines)
