"""What a backward does in place without a dispatch mode and out of place under the tracker's, for the live-storage
tracker (:mod:`memfit.measure.live_storages`).

Where a tensor gets two gradients, torch's InputBuffer (``torch/csrc/autograd/input_buffer.cpp``,
``can_accumulate_inplace``) adds the newer into the older in place when the older is a dense tensor, no view, whose
storage it holds alone; fake tensors are always summed into a new one. Some backward formulas fill a zeros tensor
they just made in place, but into a new one for tensor subclasses and while a dispatch mode (the tracker itself) is
active ("composite compliance", FunctionsManual.cpp: ``gather_backward``'s ``scatter_add_``,
``index_select_backward``'s ``index_add_``, ``index_backward``'s ``_index_put_impl_``). The tracker gives such a sum
or fill the older tensor's bytes and simulated allocator block where the older one is freed at once
(:func:`sums_gradients` and :func:`fills_in_place` find them; :class:`BlockKeys` keeps the block under its key)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense

from memfit.measure.caching_allocator import CachingAllocatorModel

_ADD = torch.ops.aten.add.Tensor
_FILLS = frozenset({torch.ops.aten.scatter_add.default, torch.ops.aten.index_add.default,
                    torch.ops.aten.index_put.default})


def _in_backward() -> bool:
    return not torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _takes_its_block(old: Any, out: Any, live: dict[int, Any]) -> bool:
    """Whether ``out`` could be ``old`` changed in place: same shape and dtype, ``old`` a dense tensor, no view,
    tracked in ``live``."""
    return (isinstance(old, torch.Tensor) and isinstance(out, torch.Tensor) and old.shape == out.shape
            and old.dtype == out.dtype and old.layout is torch.strided and not old._is_view() and _dense(old)
            and id(old.untyped_storage()) in live
            and old.untyped_storage().nbytes() == out.untyped_storage().nbytes())


def sums_gradients(func: Any, args: tuple, kwargs: dict | None, out: Any, live: dict[int, Any]) -> bool:
    """Whether operator ``func`` is ``old + new`` as autograd sums two gradients in a backward (grad mode off) that
    real tensors would sum into ``old`` (a dense tensor, no view, tracked in ``live``). Whether autograd held ``old``
    alone shows next: its storage is freed at once."""
    if func is not _ADD or kwargs or len(args) != 2 or not _in_backward():
        return False
    old, new = args
    return isinstance(new, torch.Tensor) and new.shape == out.shape and _takes_its_block(old, out, live)


def fills_in_place(func: Any, args: tuple, out: Any, live: dict[int, Any]) -> bool:
    """Whether operator ``func`` is a backward formula's out-of-place fill (``gather``'s ``scatter_add``,
    ``index_select``'s ``index_add``, indexing's ``index_put``) that torch, without a dispatch mode, runs in place.
    Whether the formula held the filled tensor alone shows next: its storage is freed at once."""
    return func in _FILLS and bool(args) and _in_backward() and _takes_its_block(args[0], out, live)


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
