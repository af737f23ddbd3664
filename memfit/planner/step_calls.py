"""What a fake step for a CUDA target tells the simulated caching allocator besides its operators' storages: the
name of the batches' copy stream, DDP's bucket blocks, an optimizer step's calls keyed for a replay, and what the
sharding's own streams reserved (:func:`memfit.planner.fake.measure_step`; composed rows replay the same calls,
:mod:`memfit.planner.row_allocator`, :mod:`memfit.planner.sharded_replay`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from memfit.measure import CachingAllocatorModel

INPUT_STREAM = "input copy"  # the simulated allocator's name for the Runner's copy stream
DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb


def ddp_buckets(total: int) -> tuple[int, ...]:
    """The blocks DDP's buckets of ``total`` gradient bytes take (``bucket_cap_mb`` each, the last the rest)."""
    return tuple(min(DDP_BUCKET, total - i) for i in range(0, total, DDP_BUCKET))


def bucket_calls(sizes: tuple[int, ...]) -> list[tuple[Hashable, int, int]]:
    """A composed row's simulated allocator calls for DDP's bucket blocks held from before its step (``sizes``:
    :func:`ddp_buckets`'), as ``CachingAllocatorModel.run`` takes them."""
    return [(("before the step", "bucket", i), n, 0) for i, n in enumerate(sizes)]


def stream_reserved(allocator: CachingAllocatorModel | None) -> int:
    """What ``allocator`` reserved on streams other than the default one and the batches' copy stream."""
    if allocator is None:
        return 0
    return sum(n for _, n, stream in allocator.segments if stream not in (0, INPUT_STREAM))


def optimizer_epilogue(calls: list[tuple[Any, int | None]]) -> list[tuple[int, int | None]]:
    """An optimizer step's allocator calls (``(key, nbytes)``, ``nbytes`` None for a free) keyed afresh by
    allocation: ``(i, nbytes)`` and ``(i, None)``. Frees of blocks made before the step (the gradients,
    ``zero_grad``) are left out: a replay frees what its own step left instead."""
    local: dict[Any, int] = {}
    out: list[tuple[int, int | None]] = []
    for n, (key, nbytes) in enumerate(calls):
        if nbytes is not None:
            local[key] = n
            out.append((n, nbytes))
        elif key in local:
            out.append((local.pop(key), None))
    return out
