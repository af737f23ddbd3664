"""The attention and feed-forward blocks of DINO's transformer, with MMCV's parameter names.

``multi_scale_deformable_attn`` is the multi-scale sampling of Deformable DETR, in one of two
implementations: on CUDA with Triton installed, memfit's Triton kernel (``memfit::ms_deform_attn``,
:mod:`deform_op`; what MMCV's CUDA kernel does: reads the value in its own dtype, accumulates in fp32, keeps
only its inputs for the backward); elsewhere, and as the reference, the same computation written with
``grid_sample`` (what mmcv's ``multi_scale_deformable_attn_pytorch`` computes). That one is our own code rather
than ``transformers``' ``MultiScaleDeformableAttention``: importing that module pulls in DeepSpeed (it
prints an accelerator warning and adds ~4 s to the import) and decorates the op with a kernel-hub
replacement; we need the op as an fp32 island under autocast anyway; and, unlike mmcv's and transformers'
pure-PyTorch versions, which sample every level at once and stack the samples, ours samples one level and
one range of queries at a time and recomputes the samples in backward, so that its memory is close to
MMCV's CUDA kernel's, which holds no samples at all (see ``_SampleAndWeigh``).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.errors import ConfigError, warn_ignored
from memfit.measure.target import device_type_of
from memfit.model.detection.dino.fp32 import fp32_island

IMPLEMENTATIONS = ("auto", "triton", "pytorch")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def deformable_implementation(value: Tensor, impl: str = "auto") -> str:
    """``'triton'`` for a computation on CUDA (or planned for CUDA) with Triton installed, else ``'pytorch'``;
    an explicit ``impl`` is kept."""
    if impl != "auto":
        return impl
    cuda = device_type_of(value) == "cuda"
    return "triton" if cuda and _triton_installed() else "pytorch"


def multi_scale_deformable_attn(value: Tensor, spatial_shapes: list[tuple[int, int]], sampling_locations: Tensor,
                                attention_weights: Tensor, chunk_elements: int | None = None,
                                impl: str = "auto") -> Tensor:
    """Sample every level at the given locations and sum with the attention weights, accumulating in fp32.

    ``value`` ``[B, S, heads, d]`` (the levels' maps flattened and concatenated), ``spatial_shapes`` the
    ``(h, w)`` of each level, ``sampling_locations`` ``[B, Q, heads, levels, points, 2]`` in ``[0, 1]``
    (x, y), ``attention_weights`` ``[B, Q, heads, levels, points]`` -> ``[B, Q, heads * d]`` in the value's
    dtype. Bilinear sampling at fractional positions loses precision in bf16/fp16, so both implementations
    compute in fp32 whatever autocast says (MMCV's CUDA kernel does too); the Triton kernel reads bf16/fp16
    values as they are, the PyTorch one copies them to fp32. ``impl``: ``'auto'`` (see
    :func:`deformable_implementation`), ``'triton'`` or ``'pytorch'``. ``chunk_elements`` bounds the PyTorch
    implementation's samples held at once (default ``CHUNK_ELEMENTS``; see ``_SampleAndWeigh``).
    """
    if deformable_implementation(value, impl) == "triton":
        from memfit.model.detection.dino import deform_op  # noqa: F401  (registers memfit::ms_deform_attn)

        shapes = [int(n) for hw in spatial_shapes for n in hw]
        return torch.ops.memfit.ms_deform_attn(value, shapes, sampling_locations, attention_weights)
    with fp32_island(value.device):
        out = _SampleAndWeigh.apply(value.float(), sampling_locations.float(), attention_weights.float(),
                                    tuple(spatial_shapes), chunk_elements or CHUNK_ELEMENTS)
    return out.to(value.dtype)


# The most samples (fp32 elements) one grid_sample call makes: 256 MiB. One level's samples,
# B * heads * d * Q * points elements, are half of an encoder layer's feed-forward hidden [B, Q, 2048] in
# DINO (256 channels, 4 points) at any image size, so going level by level already keeps the sampling
# below that layer's own backward; the chunks bound it in absolute terms too (~3 x 256 MiB held in the
# backward) for larger Q, more points or wider heads. DINO Swin-L at 2 x 1344 x 800 (~89k queries) then
# samples a level in 3 calls of up to 67M elements: far more work per call than a kernel launch costs,
# and few calls (the planner's fake step of that model runs ~15% more operators than when it sampled all
# levels in one piece; 2**25 would double the calls and the fake step's time in the op).
CHUNK_ELEMENTS = 2**26


def _query_chunks(value: Tensor, locations: Tensor, chunk_elements: int) -> list[tuple[int, int]]:
    """Query ranges whose samples of one level, ``[B * heads, d, queries, points]``, hold at most
    ``chunk_elements`` elements (at least one query each). Shapes only: no data, fake-tensor safe."""
    b, _, heads, d = value.shape
    q, points = locations.shape[1], locations.shape[4]
    step = max(1, chunk_elements // (b * heads * d * points))
    return [(start, min(start + step, q)) for start in range(0, q, step)]


def _levels(value: Tensor, locations: Tensor, weights: Tensor,
            shapes: tuple[tuple[int, int], ...]) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """One level at a time, in ``grid_sample``'s layout: the map ``[B * heads, d, h, w]``, the grid
    ``[B * heads, Q, points, 2]`` in [-1, 1] and the weights ``[B * heads, 1, Q, points]``."""
    b, _, heads, d = value.shape
    q = locations.shape[1]
    for level, (v, (h, w)) in enumerate(zip(value.split([h * w for h, w in shapes], dim=1), shapes)):
        yield (v.flatten(2).transpose(1, 2).reshape(b * heads, d, h, w),
               (2 * locations[:, :, :, level] - 1).transpose(1, 2).flatten(0, 1),
               weights[:, :, :, level].transpose(1, 2).reshape(b * heads, 1, q, -1))


def _sample_level(v: Tensor, grid: Tensor, weights: Tensor, heads: int) -> Tensor:
    """One level's bilinear samples ``[B * heads, d, q, points]`` of ``v`` at ``grid``, weighed and summed
    over the points: ``[B, q, heads, d]``."""
    sampled = F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    out = (sampled * weights).sum(-1)
    return out.view(-1, heads, *out.shape[1:]).permute(0, 3, 1, 2)


def _sample_and_weigh(value: Tensor, locations: Tensor, weights: Tensor, shapes: tuple[tuple[int, int], ...],
                      chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """The forward, level by level and query range by query range, summed into ``[B, Q, heads * d]``."""
    b, q, heads = locations.shape[:3]
    out = value.new_zeros(b, q, heads, value.shape[-1])
    chunks = _query_chunks(value, locations, chunk_elements)
    for v, grid, w in _levels(value, locations, weights, shapes):
        for start, end in chunks:
            out[:, start:end] += _sample_level(v, grid[:, start:end], w[:, :, start:end], heads)
    return out.view(b, q, -1)


class _SampleAndWeigh(torch.autograd.Function):
    """The sampling with MMCV's kernel's memory profile: only the inputs are kept for the backward, which
    recomputes the bilinear samples, and the samples exist one level and one range of queries at a time
    (``chunk_elements`` at most), in the forward and in the backward's recompute alike; the backward runs
    autograd through ``_sample_level`` for each such piece. Autograd through the whole op would keep all
    levels' samples, ``[B * heads, d, Q, levels * points]`` in fp32: 3.4 GiB per encoder layer of DINO
    Swin-L at 2 x 1344 x 800. Sampling all levels at once, as this op did, held three such tensors together
    (the samples, their stack, the product with the weights; in backward the stack and that product's two
    gradients): 10.3 GiB in every encoder layer's forward and backward recompute, the peak of the planner's
    fake DINO Swin-L step (docs/detection.md's row 1, fp32: 47.3 GiB then, 43.3 GiB after, where the peak is
    an encoder layer's feed-forward backward; 40.8 GiB with that layer's ReLU out of place). Now the op
    holds ~1.2 GiB beside its inputs, output and gradients (one level's map and its gradient, ~3 chunks of
    samples)."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, locations: Tensor, weights: Tensor,
                shapes: tuple[tuple[int, int], ...], chunk_elements: int) -> Tensor:
        ctx.save_for_backward(value, locations, weights)
        ctx.shapes, ctx.chunk_elements = shapes, chunk_elements
        return _sample_and_weigh(value, locations, weights, shapes, chunk_elements)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        value, locations, weights = ctx.saved_tensors
        b, q, heads, levels, points, _ = locations.shape
        needs = ctx.needs_input_grad[:3]
        # The gradients in grid_sample's layout (the locations' through grid = 2 * locations - 1)
        grad_value = torch.zeros_like(value) if needs[0] else None
        grad_grid = locations.new_empty(b * heads, levels, q, points, 2) if needs[1] else None
        grad_weights = weights.new_empty(b * heads, levels, 1, q, points) if needs[2] else None
        grad = grad.float().reshape(b, q, heads, -1)
        chunks = _query_chunks(value, locations, ctx.chunk_elements)
        offsets = [0, *itertools.accumulate(h * w for h, w in ctx.shapes)]
        with torch.enable_grad(), fp32_island(grad.device):
            for level, (v, grid, w) in enumerate(_levels(value.detach(), locations.detach(), weights.detach(),
                                                         ctx.shapes)):
                v.requires_grad_(needs[0])
                grad_v = None
                for start, end in chunks:
                    leaves = (v, grid[:, start:end].requires_grad_(needs[1]),
                              w[:, :, start:end].requires_grad_(needs[2]))
                    out = _sample_level(*leaves, heads)
                    got = iter(torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad[:, start:end]))
                    if needs[0]:
                        grad_v = next(got) if grad_v is None else grad_v.add_(next(got))
                    if needs[1]:
                        grad_grid[:, level, start:end] = next(got)
                    if needs[2]:
                        grad_weights[:, level, :, start:end] = next(got)
                if grad_value is not None:  # [B * heads, d, h, w] -> this level's rows of [B, S, heads, d]
                    rows = grad_value[:, offsets[level]:offsets[level + 1]]
                    rows.copy_(grad_v.view(b, heads, -1, rows.shape[1]).permute(0, 3, 1, 2))
        return (grad_value,
                None if grad_grid is None else grad_grid.mul_(2).view(b, heads, levels, q, points, 2)
                .permute(0, 3, 1, 2, 4, 5),
                None if grad_weights is None else grad_weights.view(b, heads, levels, q, points).permute(0, 3, 1, 2, 4),
                None, None)


class MultiScaleDeformableAttention(nn.Module):
    """MMCV's ``MultiScaleDeformableAttention`` (batch-first): each query attends to ``num_points`` points
    per head and level around its reference point, at offsets and with weights predicted from the query.

    Returns ``identity + dropout(output_proj(attention))``; padded positions of ``value`` are zeroed.
    ``impl`` (memfit's, MMCV has none): the sampling's implementation, ``'auto'`` (the Triton kernel on CUDA
    where Triton is installed, else ``grid_sample``), ``'triton'`` or ``'pytorch'``.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 dropout: float = 0.1, batch_first: bool = True, im2col_step: int = 64,
                 value_proj_ratio: float = 1.0, impl: str = "auto") -> None:
        super().__init__()
        if impl not in IMPLEMENTATIONS:
            raise ConfigError(f"impl={impl!r} is not a deformable attention implementation: use one of "
                              f"{', '.join(map(repr, IMPLEMENTATIONS))} ('auto': the Triton kernel on CUDA)")
        if embed_dims % num_heads:
            raise ConfigError(f"embed_dims={embed_dims} must be divisible by num_heads={num_heads}")
        if not batch_first:
            raise ConfigError("batch_first=False is not supported: memfit's DINO layers are batch-first")
        if value_proj_ratio != 1.0:
            raise ConfigError(f"value_proj_ratio={value_proj_ratio} is not supported: use 1.0")
        if im2col_step != 64:
            warn_ignored("im2col_step", "memfit's deformable attention kernel chooses its own blocks of queries")
        self.embed_dims, self.num_heads, self.impl = embed_dims, num_heads, impl
        self.num_levels, self.num_points = num_levels, num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """MMCV's init: zero offsets with a bias fanning the points out in a ring per head, zero
        attention logits (uniform weights), Xavier-uniform projections."""
        nn.init.zeros_(self.sampling_offsets.weight)
        device = self.sampling_offsets.bias.device
        thetas = torch.arange(self.num_heads, dtype=torch.float32, device=device) * (2.0 * math.pi / self.num_heads)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(self.num_heads, 1, 1, 2)
        grid = grid.repeat(1, self.num_levels, self.num_points, 1)
        grid = grid * torch.arange(1, self.num_points + 1, dtype=torch.float32, device=device).view(1, 1, -1, 1)
        self.sampling_offsets.bias.copy_(grid.view(-1))
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for proj in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, query: Tensor, value: Tensor, query_pos: Tensor | None, key_padding_mask: Tensor | None,
                reference_points: Tensor, spatial_shapes: list[tuple[int, int]]) -> Tensor:
        """``query`` ``[B, Q, C]``, ``value`` ``[B, S, C]``, ``key_padding_mask`` ``[B, S]`` (True: padding),
        ``reference_points`` ``[B, Q, levels, 2]`` (x, y) or ``[B, Q, levels, 4]`` (cx, cy, w, h), normalised."""
        identity = query
        if query_pos is not None:
            query = query + query_pos
        b, nq, _ = query.shape
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(b, value.shape[1], self.num_heads, -1)
        shape = (b, nq, self.num_heads, self.num_levels, self.num_points)
        offsets = self.sampling_offsets(query).view(*shape, 2)
        weights = self.attention_weights(query).view(b, nq, self.num_heads, -1).softmax(-1).view(shape)
        with fp32_island(query.device):
            offsets, ref = offsets.float(), reference_points.float()
            if ref.shape[-1] == 2:  # offsets in pixels of each level
                normalizer = torch.tensor([[w, h] for h, w in spatial_shapes], dtype=torch.float32, device=ref.device)
                locations = ref[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
            else:  # offsets relative to the reference box
                locations = (ref[:, :, None, :, None, :2]
                             + offsets / self.num_points * ref[:, :, None, :, None, 2:] * 0.5)
        out = multi_scale_deformable_attn(value, spatial_shapes, locations, weights, impl=self.impl)
        return identity + self.dropout(self.output_proj(out))


class MultiheadAttention(nn.Module):
    """MMCV's ``MultiheadAttention`` (batch-first): ``nn.MultiheadAttention`` on ``query + query_pos`` as
    query and key and ``query`` as value, plus the identity. ``attn_mask`` True = may not attend."""

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, dropout: float = 0.0, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, batch_first: bool = True) -> None:
        super().__init__()
        if not batch_first:
            raise ConfigError("batch_first=False is not supported: memfit's DINO layers are batch-first")
        self.embed_dims = embed_dims
        # MMCV's ``dropout`` is its deprecated name for attn_drop
        self.attn = nn.MultiheadAttention(embed_dims, num_heads, dropout=dropout or attn_drop, batch_first=True)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, query: Tensor, query_pos: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        qk = query if query_pos is None else query + query_pos
        out = self.attn(qk, qk, query, attn_mask=attn_mask, need_weights=False)[0]
        return query + self.proj_drop(out)


class FFN(nn.Module):
    """MMCV's ``FFN`` with two layers: ``x + Dropout(Linear(Dropout(ReLU(Linear(x)))))``."""

    def __init__(self, embed_dims: int = 256, feedforward_channels: int = 1024, num_fcs: int = 2,
                 ffn_drop: float = 0.0, act_cfg: dict | None = None, add_identity: bool = True) -> None:
        super().__init__()
        if num_fcs != 2:
            raise ConfigError(f"num_fcs={num_fcs} is not supported: use 2")
        if act_cfg is not None and act_cfg.get("type") != "ReLU":
            raise ConfigError(f"act_cfg={act_cfg!r} is not supported: use dict(type='ReLU', inplace=True)")
        if not add_identity:
            raise ConfigError("add_identity=False is not supported: DINO's layers add the identity")
        self.embed_dims = embed_dims
        # ReLU out of place, whatever act_cfg's inplace says (same values): in place it writes into the Linear's
        # output, which selective checkpointing saves (torch then refuses the recompute: "cached tensor mutated")
        # and of which autograd makes two extra copies in the backward.
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(embed_dims, feedforward_channels), nn.ReLU(), nn.Dropout(ffn_drop)),
            nn.Linear(feedforward_channels, embed_dims), nn.Dropout(ffn_drop))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.layers(x)
