"""Multi-scale deformable attention as Triton kernels: the sampling and its backward, as MMCV's CUDA kernel does.

One program takes ``BLOCK_Q`` queries of one image and one head and all the head's channels: for every level
and point it reads the point's location and weight, gathers the four neighbouring rows of ``value``
(``[B, S, heads, D]``, a row is a head's ``D`` contiguous channels) and adds their bilinear mix, weighed, into
an accumulator of dtype ``ACC`` (fp32; fp64 for fp64 inputs, so gradcheck can run). Nothing is kept for the
backward but the inputs: the backward recomputes the corners, reduces over the channels in registers for the
gradients of the locations and weights, and scatters the value's gradient with atomic adds into an ``ACC``
buffer (as MMCV's kernel does).

Positions follow ``grid_sample(align_corners=False, padding_mode='zeros')`` and MMCV: a location ``x`` in
``[0, 1]`` of a level ``W`` wide is at pixel ``x * W - 0.5``; neighbours outside the map count zero.

Triton decorates the kernels when this module is imported, and reads ``TRITON_INTERPRET`` then: the tests
set it and import (or reload) this module to run the kernels on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _corner(value_base, hi, wi, height, width, start, valid_q, d, d_mask, HEADS: tl.constexpr, D: tl.constexpr,
            ACC: tl.constexpr):
    """The rows ``[BLOCK_Q, BLOCK_D]`` of one neighbour (zero outside the map), its mask and its offsets."""
    valid = valid_q & (hi >= 0) & (hi < height) & (wi >= 0) & (wi < width)
    offsets = ((start + hi * width + wi).to(tl.int64) * (HEADS * D))[:, None] + d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    rows = tl.load(value_base + offsets, mask=mask, other=0.0).to(ACC)
    return rows, offsets, mask


@triton.jit
def _point(locations, weights, i, valid_q, height, width, ACC: tl.constexpr):
    """Point ``i``'s weight, its top-left neighbour ``(h0, w0)``, its fractional offsets ``(lh, lw)`` from it and
    their complements ``(hh, hw)``."""
    weight = tl.load(weights + i, mask=valid_q, other=0.0).to(ACC)
    x = tl.load(locations + 2 * i, mask=valid_q, other=0.0).to(ACC)
    y = tl.load(locations + 2 * i + 1, mask=valid_q, other=0.0).to(ACC)
    h_im = y * height.to(ACC) - 0.5
    w_im = x * width.to(ACC) - 0.5
    h0 = tl.floor(h_im)
    w0 = tl.floor(w_im)
    lh = h_im - h0
    lw = w_im - w0
    return weight, h0.to(tl.int32), w0.to(tl.int32), lh, lw, 1.0 - lh, 1.0 - lw


@triton.jit
def _block(Q, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's image ``b`` (int64), head, valid queries, channels, valid channels and its queries' rows
    of ``[B, Q, heads]``."""
    b = tl.program_id(1) // HEADS
    head = tl.program_id(1) % HEADS
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    row = (b * Q + q).to(tl.int64) * HEADS + head
    return b.to(tl.int64), head, q < Q, d, d < D, row


@triton.jit
def _level(levels, level):
    """Level ``level``'s height, width and first row of ``value`` (``levels``: int32 ``[L, 3]``)."""
    return tl.load(levels + 3 * level), tl.load(levels + 3 * level + 1), tl.load(levels + 3 * level + 2)


@triton.jit
def msda_forward(value, levels, locations, weights, out, Q, S, HEADS: tl.constexpr, D: tl.constexpr,
                 L: tl.constexpr, P: tl.constexpr, ACC: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[b, q, head]`` = sum over levels and points of weight * bilinear sample of ``value``.

    ``levels``: int32 ``[L, 3]``, each level's height, width and first row in ``value``. ``locations``
    ``[B, Q, heads, L, P, 2]`` (x, y), ``weights`` ``[B, Q, heads, L, P]``, ``out`` ``[B, Q, heads, D]``.
    Grid: ``(cdiv(Q, BLOCK_Q), B * heads)``.
    """
    b, head, valid_q, d, d_mask, row = _block(Q, HEADS, D, BLOCK_Q, BLOCK_D)
    value_base = value + b * S * HEADS * D + head * D
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=ACC)
    for level in tl.static_range(L):
        height, width, start = _level(levels, level)
        for point in tl.static_range(P):
            i = (row * L + level) * P + point
            weight, h0, w0, lh, lw, hh, hw = _point(locations, weights, i, valid_q, height, width, ACC)
            v, _, _ = _corner(value_base, h0, w0, height, width, start, valid_q, d, d_mask, HEADS, D, ACC)
            sample = (hh * hw)[:, None] * v
            v, _, _ = _corner(value_base, h0, w0 + 1, height, width, start, valid_q, d, d_mask, HEADS, D, ACC)
            sample += (hh * lw)[:, None] * v
            v, _, _ = _corner(value_base, h0 + 1, w0, height, width, start, valid_q, d, d_mask, HEADS, D, ACC)
            sample += (lh * hw)[:, None] * v
            v, _, _ = _corner(value_base, h0 + 1, w0 + 1, height, width, start, valid_q, d, d_mask, HEADS, D, ACC)
            sample += (lh * lw)[:, None] * v
            acc += weight[:, None] * sample
    out_offsets = row[:, None] * D + d[None, :]
    tl.store(out + out_offsets, acc.to(out.dtype.element_ty), mask=valid_q[:, None] & d_mask[None, :])


@triton.jit
def _corner_backward(value_base, grad_value_base, hi, wi, height, width, start, valid_q, d, d_mask, grad, scale,
                     HEADS: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr):
    """Scatter ``scale * grad`` into one neighbour's rows of the value's gradient; return ``sum_d grad * v``."""
    v, offsets, mask = _corner(value_base, hi, wi, height, width, start, valid_q, d, d_mask, HEADS, D, ACC)
    tl.atomic_add(grad_value_base + offsets, scale[:, None] * grad, mask=mask)
    return tl.sum(grad * v, axis=1)


@triton.jit
def msda_backward(value, levels, locations, weights, grad_out, grad_value, grad_locations, grad_weights, Q, S,
                  HEADS: tl.constexpr, D: tl.constexpr, L: tl.constexpr, P: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """The gradients of :func:`msda_forward`: ``grad_value`` (``ACC``, zeroed by the caller) by atomic adds,
    ``grad_locations`` and ``grad_weights`` written once per point. Same grid and layouts as the forward."""
    b, head, valid_q, d, d_mask, row = _block(Q, HEADS, D, BLOCK_Q, BLOCK_D)
    base = b * S * HEADS * D + head * D
    value_base = value + base
    grad_value_base = grad_value + base
    grad = tl.load(grad_out + row[:, None] * D + d[None, :], mask=valid_q[:, None] & d_mask[None, :],
                   other=0.0).to(ACC)
    for level in tl.static_range(L):
        height, width, start = _level(levels, level)
        for point in tl.static_range(P):
            i = (row * L + level) * P + point
            weight, h0, w0, lh, lw, hh, hw = _point(locations, weights, i, valid_q, height, width, ACC)
            # Each neighbour: its bilinear weight and that weight's derivatives by lw and lh.
            g = _corner_backward(value_base, grad_value_base, h0, w0, height, width, start, valid_q, d, d_mask,
                                 grad, weight * hh * hw, HEADS, D, ACC)
            grad_weight = hh * hw * g
            grad_lw = -hh * g
            grad_lh = -hw * g
            g = _corner_backward(value_base, grad_value_base, h0, w0 + 1, height, width, start, valid_q, d, d_mask,
                                 grad, weight * hh * lw, HEADS, D, ACC)
            grad_weight += hh * lw * g
            grad_lw += hh * g
            grad_lh -= lw * g
            g = _corner_backward(value_base, grad_value_base, h0 + 1, w0, height, width, start, valid_q, d, d_mask,
                                 grad, weight * lh * hw, HEADS, D, ACC)
            grad_weight += lh * hw * g
            grad_lw -= lh * g
            grad_lh += hw * g
            g = _corner_backward(value_base, grad_value_base, h0 + 1, w0 + 1, height, width, start, valid_q, d,
                                 d_mask, grad, weight * lh * lw, HEADS, D, ACC)
            grad_weight += lh * lw * g
            grad_lw += lh * g
            grad_lh += lw * g
            # x * W - 0.5 and y * H - 0.5: the pixel offsets' gradients scaled back to [0, 1] locations
            tl.store(grad_weights + i, grad_weight.to(grad_weights.dtype.element_ty), mask=valid_q)
            tl.store(grad_locations + 2 * i, (weight * grad_lw * width.to(ACC)).to(grad_locations.dtype.element_ty),
                     mask=valid_q)
            tl.store(grad_locations + 2 * i + 1,
                     (weight * grad_lh * height.to(ACC)).to(grad_locations.dtype.element_ty), mask=valid_q)


def block_sizes(d: int) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_D)``: all of a head's channels in one block, ~2k accumulator elements a program."""
    block_d = triton.next_power_of_2(d)
    return max(16, min(128, 2048 // block_d)), block_d
