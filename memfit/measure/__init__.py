"""The measurement engine: how much memory a step's tensors take, for the planner and for
:class:`memfit.hooks.MemoryMonitorHook` (``cfg.memory_monitor``).

* :mod:`~memfit.measure.tracker`: :class:`MemoryTracker`, the peak of the code it wraps with a breakdown
  by category (parameters, gradients, optimizer state, activations, ...): on CUDA the allocator's own
  peak, on CPU, meta and fake tensors the live storages;
* :mod:`~memfit.measure.live_storages`: the ``TorchDispatchMode`` that counts live storages by category;
* :mod:`~memfit.measure.caching_allocator`: a model of CUDA's caching allocator, replayed over those
  storages to give what ``max_memory_allocated``/``max_memory_reserved`` would read on a GPU;
* :mod:`~memfit.measure.storages`: finding the storages of parameters, gradients and optimizer state;
* :mod:`~memfit.measure.target`: the device a step is measured for (a fake CPU step planned for a GPU).

It imports nothing else of memfit (layer 0, docs/architecture.md). The memory *techniques* applied to
the model are :mod:`memfit.memory`.
"""

from memfit.measure.caching_allocator import CachingAllocatorModel
from memfit.measure.live_storages import CATEGORIES, HOST, LiveStorages
from memfit.measure.storages import optimizer_state_tensors, storages
from memfit.measure.tracker import MB, MemoryTracker

__all__ = [
    "CATEGORIES", "HOST", "MB", "CachingAllocatorModel", "LiveStorages", "MemoryTracker",
    "optimizer_state_tensors", "storages",
]
