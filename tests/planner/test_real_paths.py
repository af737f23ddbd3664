"""The fake step takes a CUDA device's paths (memfit.planner.real_paths): on a CUDA target an attention mask not
aligned to 8 elements is padded into a copy that the attention's backward keeps."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure import CachingAllocatorModel, MemoryTracker
from memfit.planner.real_paths import real_paths


def _allocations(step, paths: bool, cuda: bool = False) -> tuple[list[int], list[int], int]:
    """The sizes ``step()`` allocates on fake tensors, in its forward and in its backward (``step`` returns the loss),
    and the tracker's peak, with or without :func:`real_paths`."""
    with FakeTensorMode(), real_paths(cuda) if paths else contextlib.nullcontext():
        allocator = CachingAllocatorModel()
        with MemoryTracker(allocator=allocator) as tracker:
            loss = step()
            start = len(allocator.trace)
            loss.backward()
        sizes = [n for _, n in allocator.trace if n is not None]
        forward = [n for _, n in allocator.trace[:start] if n is not None]
        return forward, sizes[len(forward):], tracker.peak_bytes


def test_torch_functions_are_back_when_the_context_closes():
    sdpa = F.scaled_dot_product_attention
    with real_paths(cuda=True):
        assert F.scaled_dot_product_attention is not sdpa
        with real_paths(cuda=True):
            pass
        assert F.scaled_dot_product_attention is not sdpa  # re-entrant: the inner exit leaves the outer's patch
    assert F.scaled_dot_product_attention is sdpa
    with real_paths(cuda=False):
        assert F.scaled_dot_product_attention is sdpa


def _attention(tokens: int, bool_mask: bool = False):
    def step() -> torch.Tensor:
        q, k, v = (torch.randn(2, 4, tokens, 8, requires_grad=True) for _ in range(3))
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril() if bool_mask else torch.randn(tokens, tokens)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()
    return step


@pytest.mark.parametrize("bool_mask", [False, True])
def test_a_cuda_targets_attention_pads_its_mask_and_keeps_the_copy_for_backward(bool_mask):
    """10 keys: the memory-efficient kernel's mask has rows of 16 (10 x 16 fp32, 640 bytes), made in the forward and
    held to the backward; a boolean mask is made additive first (10 x 10 fp32)."""
    forward, backward, _ = _allocations(_attention(10, bool_mask), paths=True, cuda=True)
    assert forward.count(10 * 16 * 4) == 1 and backward.count(10 * 16 * 4) == 0
    cpu, _, _ = _allocations(_attention(10, bool_mask), paths=True, cuda=False)
    assert cpu.count(10 * 16 * 4) == 0
    with FakeTensorMode(), real_paths(cuda=True):
        allocator = CachingAllocatorModel()
        with MemoryTracker(allocator=allocator):
            loss = _attention(10, bool_mask)()
            padded = [key for key, n in allocator.trace if n == 10 * 16 * 4]
            assert allocator.address(padded[0]) is not None  # alive at the end of the forward
            loss.backward()
            del loss
        assert allocator.address(padded[0]) is None


def test_an_aligned_mask_is_not_copied():
    forward, _, _ = _allocations(_attention(16), paths=True, cuda=True)
    plain, _, _ = _allocations(_attention(16), paths=False, cuda=True)
    assert forward == plain


def test_under_autocast_the_padded_copy_is_of_the_autocast_dtype():
    """CUDA's autocast casts the mask before the kernel pads it: beside the cast (10 x 10 bf16, which a CPU makes too)
    the one block more is the padded copy the backward keeps, bf16 (10 x 16 x 2 bytes), not fp32."""
    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _attention(10)()

    forward, _, _ = _allocations(step, paths=True, cuda=True)
    cpu, _, _ = _allocations(step, paths=True, cuda=False)
    more = [n for n in set(forward) | set(cpu) if forward.count(n) != cpu.count(n)]
    assert sorted((n, forward.count(n) - cpu.count(n)) for n in more) == [(10 * 16 * 2, 1)]
