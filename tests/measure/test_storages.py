"""An operator's outputs reach the simulated CUDA allocator in the order its kernel allocates them (layer norm: the
output, then the mean and the inverse deviation; a detector's deformable-attention backward: the value's gradient,
the locations', the weights'); they used to arrive last first."""

from __future__ import annotations

import torch
from torch import nn

from memfit.measure import CachingAllocatorModel, MemoryTracker, storages


def test_storages_come_in_order():
    a, b, c, d = (torch.zeros(n) for n in (1, 2, 3, 4))
    assert [s.nbytes() for s in storages((a, [b, {"x": c, "y": d}]))] == [4, 8, 12, 16]


def test_an_operators_outputs_are_allocated_in_order():
    model = nn.LayerNorm(256)
    x = torch.randn(64, 256, requires_grad=True)
    allocator = CachingAllocatorModel()
    with MemoryTracker(model, allocator=allocator):
        first = len(allocator.trace)
        torch.native_layer_norm(x, (256,), model.weight, model.bias, 1e-5)
    made = [n for _, n in allocator.trace[first:] if n is not None]  # the input (first seen here), then the outputs
    assert made[-3:] == [64 * 256 * 4, 64 * 4, 64 * 4]
