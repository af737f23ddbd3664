"""``memfit::ms_deform_attn``: the Triton kernel of :mod:`deform_kernel` as a torch operator.

A ``torch.library`` custom op with its backward as a second op, so that autograd, ``torch.compile`` and fake
tensors see one operator each way. Their fake implementations declare the outputs only (the forward's
``[B, Q, heads * D]`` in the value's dtype; the backward's value gradient in the fp32 accumulator, cast to the
value's dtype by autograd's formula, and the locations' and weights' gradients): the planner's fake step
predicts the kernel path's memory from them, and nothing but the inputs is kept for the backward.

Triton is imported when a kernel first runs, not with this module: a CPU install plans the kernel path
without it.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import Tensor


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for fp32/bf16/fp16 inputs; fp64 for fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=64)
def _levels(shapes: tuple[int, ...], device: torch.device) -> Tensor:
    """int32 ``[L, 3]``: each level's height, width and first row; made once per set of shapes and device
    (the copy to the device then happens once, not in every step)."""
    hw = list(zip(shapes[0::2], shapes[1::2]))
    starts = [0, *itertools.accumulate(h * w for h, w in hw)][:-1]
    return torch.tensor([[h, w, s] for (h, w), s in zip(hw, starts)], dtype=torch.int32, device=device)


def _launch(kernel_name: str, value: Tensor, shapes: list[int], locations: Tensor, *tensors: Tensor) -> None:
    import triton

    from memfit.model.detection.dino import deform_kernel

    b, s, heads, d = value.shape
    q, _, levels, points = locations.shape[1:5]
    block_q, block_d = deform_kernel.block_sizes(d)
    acc = {torch.float64: deform_kernel.tl.float64}.get(value.dtype, deform_kernel.tl.float32)
    kernel = getattr(deform_kernel, kernel_name)
    kernel[(triton.cdiv(q, block_q), b * heads)](
        value, _levels(tuple(shapes), value.device), locations, *tensors, q, s,
        HEADS=heads, D=d, L=levels, P=points, ACC=acc, BLOCK_Q=block_q, BLOCK_D=block_d)


def _check(value: Tensor, shapes: list[int], locations: Tensor, weights: Tensor) -> None:
    b, s, heads, _ = value.shape
    levels = len(shapes) // 2
    if sum(h * w for h, w in zip(shapes[0::2], shapes[1::2])) != s:
        raise ValueError(f"ms_deform_attn: the levels' shapes {shapes} cover {s} rows of value only if their "
                         f"areas sum to {s}")
    if locations.shape[:4] != (b, locations.shape[1], heads, levels) or locations.shape[-1] != 2:
        raise ValueError(f"ms_deform_attn: locations {tuple(locations.shape)} must be [B, Q, heads, levels, "
                         f"points, 2] for value {tuple(value.shape)} and {levels} levels")
    if weights.shape != locations.shape[:-1]:
        raise ValueError(f"ms_deform_attn: weights {tuple(weights.shape)} must be {tuple(locations.shape[:-1])}")


@torch.library.custom_op("memfit::ms_deform_attn", mutates_args=())
def ms_deform_attn(value: Tensor, shapes: list[int], locations: Tensor, weights: Tensor) -> Tensor:
    """The sampling: ``value`` ``[B, S, heads, D]``, ``shapes`` the levels' ``h0, w0, h1, w1, ...``,
    ``locations`` ``[B, Q, heads, levels, points, 2]`` in [0, 1] (x, y), ``weights`` ``[B, Q, heads, levels,
    points]`` -> ``[B, Q, heads * D]`` in the value's dtype (accumulated in fp32)."""
    _check(value, shapes, locations, weights)
    value, locations, weights = value.contiguous(), locations.contiguous(), weights.contiguous()
    b, _, heads, d = value.shape
    out = value.new_empty(b, locations.shape[1], heads, d)
    _launch("msda_forward", value, shapes, locations, weights, out)
    return out.view(b, -1, heads * d)


@ms_deform_attn.register_fake
def _(value: Tensor, shapes: list[int], locations: Tensor, weights: Tensor) -> Tensor:
    _check(value, shapes, locations, weights)
    return value.new_empty(value.shape[0], locations.shape[1], value.shape[2] * value.shape[3])


@torch.library.custom_op("memfit::ms_deform_attn_backward", mutates_args=())
def ms_deform_attn_backward(grad: Tensor, value: Tensor, shapes: list[int], locations: Tensor,
                            weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`ms_deform_attn` for the value (in the fp32 accumulator), the locations and
    the weights."""
    value, locations, weights = value.contiguous(), locations.contiguous(), weights.contiguous()
    grad_value = torch.zeros(value.shape, dtype=_accumulator(value.dtype), device=value.device)
    grad_locations, grad_weights = torch.empty_like(locations), torch.empty_like(weights)
    _launch("msda_backward", value, shapes, locations, weights, grad.contiguous(), grad_value, grad_locations,
            grad_weights)
    return grad_value, grad_locations, grad_weights


@ms_deform_attn_backward.register_fake
def _(grad: Tensor, value: Tensor, shapes: list[int], locations: Tensor,
      weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    grad_value = value.new_empty(value.shape, dtype=_accumulator(value.dtype))
    return grad_value, torch.empty_like(locations), torch.empty_like(weights)


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    value, shapes, locations, weights = inputs
    ctx.save_for_backward(value, locations, weights)
    ctx.shapes = shapes


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    value, locations, weights = ctx.saved_tensors
    grad_value, grad_locations, grad_weights = ms_deform_attn_backward(grad, value, ctx.shapes, locations, weights)
    return (grad_value.to(value.dtype) if ctx.needs_input_grad[0] else None, None,
            grad_locations if ctx.needs_input_grad[2] else None, grad_weights if ctx.needs_input_grad[3] else None)


ms_deform_attn.register_autograd(_backward, setup_context=_setup_context)
