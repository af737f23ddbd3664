"""The next batch copied to the GPU while the current step runs (timm's PrefetchLoader, Lightning's
device transfer): the training loop's input path on CUDA.

A batch from a pinned DataLoader is copied with ``non_blocking=True`` on a side stream as soon as the
step before it has been queued, so the copy overlaps that step's kernels instead of preceding the
next one. The compute stream waits for the copy before it uses the batch (``wait_stream``), and each
copied tensor is marked as used by the compute stream (``record_stream``) so the caching allocator
does not hand its memory to the next copy while the step still reads it. Neither blocks the host.

Only the data's order of arrival changes: batch i+1 is taken from the loader before step i runs.
The sampler's position (what a checkpoint stores) is advanced by the loop per step, not by the
loader, and :class:`~memfit.data.seeded.SeededDataset` loads each sample under its own seeds, so
resuming stays exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memfit.model.base import map_tensors, move_to

_END = object()


def prefetch(batches: Iterator, device: torch.device, ahead: bool | None = None) -> Iterator:
    """Iterate ``batches`` with each one's tensors already on ``device``, the next one's copy under way.

    ``ahead`` (default: on CUDA) takes each batch from ``batches`` one step early; without it the
    batches are passed through unchanged (on a CPU a copy ahead gains nothing)."""
    if ahead is None:
        ahead = device.type == "cuda"
    if not ahead:
        return batches
    return _ahead(batches, device)


def _ahead(batches: Iterator, device: torch.device) -> Iterator:
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None

    def load() -> Any:
        batch = next(batches, _END)
        if batch is _END or stream is None:
            return batch if batch is _END else move_to(batch, device)
        with torch.cuda.stream(stream):
            return move_to(batch, device, non_blocking=True)

    upcoming = load()
    while upcoming is not _END:
        batch = upcoming
        if stream is not None:
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            _record(batch, current)
        upcoming = load()  # queued on the side stream now, copied while the caller runs its step on ``batch``
        yield batch


def _record(data: Any, stream: torch.cuda.Stream) -> None:
    """Mark every CUDA tensor in ``data`` as used by ``stream`` (it was allocated on the copy stream)."""
    map_tensors(data, lambda t: t.record_stream(stream) if t.is_cuda else None)
