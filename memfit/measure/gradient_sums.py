"""Autograd's in-place gradient sums, for the live-storage tracker (:mod:`memfit.measure.live_storages`).

Where a tensor gets two gradients, torch's InputBuffer (``torch/csrc/autograd/input_buffer.cpp``,
``can_accumulate_inplace``) adds the newer into the older in place when the older is a dense tensor, no view, whose
storage it holds alone; fake tensors are always summed into a new one. The tracker gives such a sum the older
gradient's bytes and simulated allocator block (:func:`sums_gradients` finds the sums; :class:`BlockKeys` keeps the
block under its key)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense

from memfit.measure.caching_allocator import CachingAllocatorModel

_ADD = torch.ops.aten.add.Tensor


def sums_gradients(func: Any, args: tuple, kwargs: dict | None, out: Any, live: dict[int, Any]) -> bool:
    """Whether operator ``func`` is ``old + new`` as autograd sums two gradients in a backward (grad mode off) that
    real tensors would sum into ``old`` (a dense tensor, no view, tracked in ``live``). Whether autograd held ``old``
    alone shows next: its storage is freed at once."""
    if func is not _ADD or kwargs or len(args) != 2 or torch.is_grad_enabled() or \
            torch._C._current_graph_task_id() == -1:
        return False
    old, new = args
    return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(out, torch.Tensor)
            and old.shape == new.shape == out.shape and old.dtype == out.dtype and old.layout is torch.strided
            and not old._is_view() and _dense(old) and id(old.untyped_storage()) in live
            and old.untyped_storage().nbytes() == out.untyped_storage().nbytes())


class BlockKeys:
    """The simulated allocator's key of each storage's block: its id, but for a sum summed in place, which holds the
    older gradient's block under that storage's id; Python may give the id to a new storage meanwhile, which then
    takes a fresh key."""

    def __init__(self) -> None:
        self._block: dict[int, Hashable] = {}  # a storage -> its block's key, where that is not its id
        self._borrowed: set[Hashable] = set()  # keys of blocks a storage of another id holds
        self._fresh = itertools.count()

    def malloc(self, allocator: CachingAllocatorModel, key: int, nbytes: int, stream: Hashable) -> None:
        """A block for storage ``key``."""
        if key in self._borrowed:
            self._block[key] = ("storage", next(self._fresh))
        allocator.malloc(self._block.get(key, key), nbytes, stream)

    def free(self, allocator: CachingAllocatorModel, key: int) -> None:
        """Free storage ``key``'s block (its own, or the one it took over)."""
        block = self._block.pop(key, key)
        self._borrowed.discard(block)
        allocator.free(block)

    def take_over(self, key: int, old_key: int) -> None:
        """Storage ``key`` holds storage ``old_key``'s block from now on (``old_key`` was just freed)."""
        block = self._block[key] = self._block.pop(old_key, old_key)
        self._borrowed.add(block)
