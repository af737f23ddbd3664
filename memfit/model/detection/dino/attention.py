"""The attention and feed-forward blocks of DINO's transformer, with MMCV's parameter names.

``multi_scale_deformable_attn`` is the multi-scale sampling of Deformable DETR written with
``grid_sample`` (what mmcv's ``multi_scale_deformable_attn_pytorch`` does). It is our own 30 lines rather
than ``transformers``' ``MultiScaleDeformableAttention``: importing that module pulls in DeepSpeed (it
prints an accelerator warning and adds ~4 s to the import) and decorates the op with a kernel-hub
replacement, and we need the op as an fp32 island under autocast anyway.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.errors import ConfigError, warn_ignored
from memfit.model.detection.dino.fp32 import fp32_island


def multi_scale_deformable_attn(value: Tensor, spatial_shapes: list[tuple[int, int]], sampling_locations: Tensor,
                                attention_weights: Tensor) -> Tensor:
    """Sample every level at the given locations and sum with the attention weights, in fp32.

    ``value`` ``[B, S, heads, d]`` (the levels' maps flattened and concatenated), ``spatial_shapes`` the
    ``(h, w)`` of each level, ``sampling_locations`` ``[B, Q, heads, levels, points, 2]`` in ``[0, 1]``
    (x, y), ``attention_weights`` ``[B, Q, heads, levels, points]`` -> ``[B, Q, heads * d]`` (fp32).
    Bilinear sampling at fractional positions loses precision in bf16/fp16, so autocast is off here
    (MMCV's CUDA kernel is fp32 too).
    """
    with fp32_island(value.device):
        return _SampleAndWeigh.apply(value.float(), sampling_locations.float(), attention_weights.float(),
                                     tuple(spatial_shapes))


def _sample_and_weigh(value: Tensor, locations: Tensor, weights: Tensor, shapes: tuple[tuple[int, int], ...]) -> Tensor:
    b, _, heads, d = value.shape
    _, q, _, levels, points, _ = locations.shape
    values = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * locations - 1  # grid_sample's [-1, 1] coordinates
    sampled = []
    for level, (h, w) in enumerate(shapes):
        v = values[level].flatten(2).transpose(1, 2).reshape(b * heads, d, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)  # [B * heads, Q, points, 2]
        sampled.append(F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = weights.transpose(1, 2).reshape(b * heads, 1, q, levels * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(b, heads * d, q)
    return out.transpose(1, 2).contiguous()


class _SampleAndWeigh(torch.autograd.Function):
    """The sampling with MMCV's kernel's memory profile: only the inputs are kept for the backward, which
    recomputes the bilinear samples. Autograd through ``_sample_and_weigh`` would keep the samples,
    ``[B * heads, d, Q, levels * points]`` in fp32: about 1 GB per encoder layer of DINO Swin-L at 2 x
    800 x 1344, 6 layers (its fake-tensor fp32 step peaks at 62.5 GiB that way, 44.8 GiB with this)."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, locations: Tensor, weights: Tensor,
                shapes: tuple[tuple[int, int], ...]) -> Tensor:
        ctx.save_for_backward(value, locations, weights)
        ctx.shapes = shapes
        return _sample_and_weigh(value, locations, weights, shapes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        needs = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad(), fp32_island(grad.device):
            out = _sample_and_weigh(*inputs, ctx.shapes)
        grads = iter(torch.autograd.grad(out, [t for t, need in zip(inputs, needs) if need], grad.float()))
        return (*(next(grads) if need else None for need in needs), None)


class MultiScaleDeformableAttention(nn.Module):
    """MMCV's ``MultiScaleDeformableAttention`` (batch-first): each query attends to ``num_points`` points
    per head and level around its reference point, at offsets and with weights predicted from the query.

    Returns ``identity + dropout(output_proj(attention))``; padded positions of ``value`` are zeroed.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 dropout: float = 0.1, batch_first: bool = True, im2col_step: int = 64,
                 value_proj_ratio: float = 1.0) -> None:
        super().__init__()
        if embed_dims % num_heads:
            raise ConfigError(f"embed_dims={embed_dims} must be divisible by num_heads={num_heads}")
        if not batch_first:
            raise ConfigError("batch_first=False is not supported: memfit's DINO layers are batch-first")
        if value_proj_ratio != 1.0:
            raise ConfigError(f"value_proj_ratio={value_proj_ratio} is not supported: use 1.0")
        if im2col_step != 64:
            warn_ignored("im2col_step", "the deformable attention is pure PyTorch (grid_sample), not MMCV's kernel")
        self.embed_dims, self.num_heads = embed_dims, num_heads
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
        out = multi_scale_deformable_attn(value, spatial_shapes, locations, weights)
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
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(embed_dims, feedforward_channels), nn.ReLU(inplace=True), nn.Dropout(ffn_drop)),
            nn.Linear(feedforward_channels, embed_dims), nn.Dropout(ffn_drop))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.layers(x)
