"""Two gradients of one tensor: autograd's InputBuffer adds the newer into the older in place where the older is a
dense tensor, no view, that it holds alone (torch/csrc/autograd/input_buffer.cpp, ``can_accumulate_inplace``), and
into a new tensor otherwise. Fake tensors are always summed out of place; the tracker gives such a sum the older
gradient's block, so that a fake step allocates what a real one does (the H100 traces: ViT's, ResNet's and DINO's
sums allocate nothing; Swin's, whose older gradient is a view through its window reshapes, a new block)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure import CachingAllocatorModel, MemoryTracker
from memfit.measure import live_storages as ls


def _backward_allocations(view_first: bool, fake: bool) -> tuple[list[int], int]:
    """The sizes a backward allocates where ``h`` (64 x 64 fp32, 16 KiB) gets two gradients, and the tracker's
    peak. ``view_first``: the first to arrive is a view (a transpose's gradient), so the sum is a new tensor."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.randn(64, 32)
        w = torch.randn(32, 64, requires_grad=True)
        allocator = CachingAllocatorModel()
        with MemoryTracker(allocator=allocator) as tracker:
            h = x @ w
            # Autograd runs the later-made branch first: its gradient is the older one in h's buffer.
            y = h.exp().sum() + (h.t() * 2).sum() if view_first else (h.t() * 2).sum() + h.exp().sum()
            start = len(allocator.trace)
            y.backward()
        return [n for _, n in allocator.trace[start:] if n is not None], tracker.peak_bytes


@pytest.mark.parametrize("view_first", [False, True])
def test_a_fake_backward_sums_gradients_where_a_real_one_does(view_first):
    real, real_peak = _backward_allocations(view_first, fake=False)
    fake, fake_peak = _backward_allocations(view_first, fake=True)
    assert real.count(64 * 64 * 4) == (3 if view_first else 2)  # the two gradients (and the sum, out of place)
    assert fake == real
    assert fake_peak == real_peak


def test_summed_out_of_place_the_fake_backward_would_allocate_one_block_more(monkeypatch):
    monkeypatch.setattr(ls, "sums_gradients", lambda *args: False)
    fake, _ = _backward_allocations(view_first=False, fake=True)
    assert fake.count(64 * 64 * 4) == 3


def _fill_allocations(op: str, fake: bool) -> tuple[list[int], int]:
    """The sizes a backward allocates for ``op``'s gradient (a 256 x 64 fp32 input, 64 KiB: gather's, index_select's
    or indexing's, each a zeros tensor of the input's size filled), and the tracker's peak."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.randn(256, 64, requires_grad=True)
        index = torch.arange(0, 256, 2)
        allocator = CachingAllocatorModel()
        with MemoryTracker(allocator=allocator) as tracker:
            if op == "gather":
                y = x.gather(0, index[:, None].expand(-1, 64))
            elif op == "index_select":
                y = x.index_select(0, index)
            else:
                y = x[index]
            start = len(allocator.trace)
            y.exp().sum().backward()
        return [n for _, n in allocator.trace[start:] if n is not None], tracker.peak_bytes


@pytest.mark.parametrize("op", ["gather", "index_select", "index"])
def test_a_tracked_backward_fills_a_new_zeros_tensor_in_place_as_torch_does_untracked(op):
    """gather's, index_select's and indexing's backward formulas fill a zeros tensor of the input's size in place, but
    into a new one for fake tensors and under any dispatch mode, the tracker's own (FunctionsManual.cpp's composite
    compliance paths): tracked, real and fake tensors alike allocate one block of x's size, the zeros filled in place
    that AccumulateGrad then takes as x.grad."""
    real, real_peak = _fill_allocations(op, fake=False)
    fake, fake_peak = _fill_allocations(op, fake=True)
    assert real.count(256 * 64 * 4) == 1
    assert fake == real
    assert fake_peak == real_peak


def test_filled_out_of_place_the_tracked_backward_would_allocate_one_block_more(monkeypatch):
    monkeypatch.setattr(ls, "fills_in_place", lambda *args: False)
    for fake in (False, True):
        assert _fill_allocations("gather", fake=fake)[0].count(256 * 64 * 4) == 2
