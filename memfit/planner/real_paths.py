"""The fake step takes the paths a CUDA device takes, where a CPU's would take others.

On a CUDA target, ``scaled_dot_product_attention`` with a mask runs the memory-efficient kernel, which takes the
mask with its rows padded to a multiple of 8 elements (``preprocess_mask`` in attention.cpp) and keeps that copy for
its backward; a CPU passes the mask as it is (DINO's decoder: 1098 x 1104 fp32, 4.6 MiB in each of its six layers on
an H100). :func:`real_paths`, around a fake step, pads it so. The patch is the function ``torch.nn.functional``
holds, which ``nn.MultiheadAttention``'s functional form calls; it is process-wide while the context is open.

The backward formulas that fill a new zeros tensor out of place under a dispatch mode and in place without one
(``gather``'s, ``index_select``'s, indexing's) are the live-storage tracker's
(:func:`memfit.measure.gradient_sums.fills_in_place`). Not taken: ``F.linear`` over a non-contiguous input adds its
bias in place without a dispatch mode and into a new tensor under one (``linear`` in ATen's Linear.cpp; one more
block of the output's size for an instant, three of 2.1 MiB in each DINO decoder layer's self-attention). Selective
checkpointing, whose dispatch mode a GPU's step runs under too, takes the out-of-place path, and the planner composes
its rows from the same recording as the others', so the fake step keeps torch's path under its own modes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

_SDPA = torch._C._nn.scaled_dot_product_attention
_MASK_ALIGNMENT = 8  # preprocess_mask's mem_eff_alignment
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_lock = threading.Lock()
_depth = [0]


def _aligned(mask: torch.Tensor) -> bool:
    """``aligned_tensor<8>``: every stride but the last a multiple of 8 elements, the last 1."""
    return mask.stride(-1) == 1 and all(s % _MASK_ALIGNMENT == 0 for s in mask.stride()[:-1])


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the mask a CUDA device's memory-efficient kernel takes: cast as
    autocast casts it (the CPU's autocast standing in for CUDA's), a boolean mask made additive, then a copy padded to
    whole rows of 8 (a view of it without the padding) where the mask's strides are not aligned. The copy lives as
    long as the attention's saved tensors."""
    head = query.shape[-1] if query.dim() else 0
    if attn_mask is not None and attn_mask.dim() and query.dtype in _EFFICIENT_DTYPES and head % 8 == 0:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        if attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask: where(mask, 0, -inf)
            zero = torch.zeros((), dtype=dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
        elif attn_mask.dtype != dtype:
            attn_mask = attn_mask.to(dtype)
        if not _aligned(attn_mask):
            size = attn_mask.shape[-1]
            attn_mask = F.pad(attn_mask, (0, _MASK_ALIGNMENT - size % _MASK_ALIGNMENT))[..., :size]
    return _SDPA(query, key, value, attn_mask, *args, **kwargs)


@contextlib.contextmanager
def real_paths(cuda: bool) -> Iterator[None]:
    """While open with ``cuda``, attention masks are padded as a CUDA device's memory-efficient attention pads
    them (module docstring); without, nothing changes. Re-entrant."""
    if not cuda:
        yield
        return
    with _lock:
        _depth[0] += 1
        if _depth[0] == 1:
            F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                F.scaled_dot_product_attention = _SDPA
