"""DINO's deformable transformer: the encoder over multi-scale features and the decoder with box refinement.

Each layer is a module called as ``layer(...)`` from its stack's loop, so memfit's activation checkpointing
(which replaces a module's ``forward``) applies to ``encoder.layers.<i>`` / ``decoder.layers.<i>`` or to the
types ``DeformableEncoderLayer`` / ``DeformableDecoderLayer``. Parameter names follow MMDetection's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from memfit.errors import ConfigError
from memfit.model.detection.dino.attention import FFN, MultiheadAttention, MultiScaleDeformableAttention
from memfit.model.detection.dino.config import build_part
from memfit.model.detection.dino.positional import coordinate_to_encoding

LAYER_KEYS = ("self_attn_cfg", "ffn_cfg", "norm_cfg")


def _check_norm(norm_cfg: dict | None) -> None:
    if norm_cfg is not None and norm_cfg.get("type", "LN") != "LN":
        raise ConfigError(f"norm_cfg={norm_cfg!r} is not supported: use dict(type='LN')")


class DeformableEncoderLayer(nn.Module):
    """Post-norm encoder layer: deformable self-attention over all levels, then the FFN."""

    def __init__(self, self_attn_cfg: dict | None = None, ffn_cfg: dict | None = None,
                 norm_cfg: dict | None = None) -> None:
        super().__init__()
        _check_norm(norm_cfg)
        self.self_attn = build_part(MultiScaleDeformableAttention, self_attn_cfg, "self_attn_cfg")
        self.ffn = build_part(FFN, ffn_cfg, "ffn_cfg")
        self.embed_dims = self.self_attn.embed_dims
        self.norms = nn.ModuleList(nn.LayerNorm(self.embed_dims) for _ in range(2))

    def forward(self, query: Tensor, query_pos: Tensor, key_padding_mask: Tensor | None, reference_points: Tensor,
                spatial_shapes: list[tuple[int, int]]) -> Tensor:
        query = self.self_attn(query, query, query_pos, key_padding_mask, reference_points, spatial_shapes)
        query = self.norms[0](query)
        return self.norms[1](self.ffn(query))


class DeformableDecoderLayer(nn.Module):
    """Post-norm decoder layer: self-attention among the queries (the denoising mask keeps groups apart),
    deformable cross-attention into the encoder memory, then the FFN."""

    def __init__(self, self_attn_cfg: dict | None = None, cross_attn_cfg: dict | None = None,
                 ffn_cfg: dict | None = None, norm_cfg: dict | None = None) -> None:
        super().__init__()
        _check_norm(norm_cfg)
        self.self_attn = build_part(MultiheadAttention, self_attn_cfg, "self_attn_cfg")
        self.cross_attn = build_part(MultiScaleDeformableAttention, cross_attn_cfg, "cross_attn_cfg")
        self.ffn = build_part(FFN, ffn_cfg, "ffn_cfg")
        self.embed_dims = self.self_attn.embed_dims
        self.norms = nn.ModuleList(nn.LayerNorm(self.embed_dims) for _ in range(3))

    def forward(self, query: Tensor, query_pos: Tensor, value: Tensor, key_padding_mask: Tensor | None,
                self_attn_mask: Tensor | None, reference_points: Tensor,
                spatial_shapes: list[tuple[int, int]]) -> Tensor:
        query = self.norms[0](self.self_attn(query, query_pos, self_attn_mask))
        query = self.cross_attn(query, value, query_pos, key_padding_mask, reference_points, spatial_shapes)
        query = self.norms[1](query)
        return self.norms[2](self.ffn(query))


class DeformableEncoder(nn.Module):
    """``num_layers`` encoder layers in ``self.layers``; each query is a feature position whose reference
    point is its own centre on every level. ``num_cp`` (MMDetection's): checkpoint the first ``num_cp``
    layers with memfit's activation checkpointing (the same as naming ``encoder.layers.<i>``)."""

    def __init__(self, num_layers: int = 6, layer_cfg: dict | None = None, num_cp: int = -1) -> None:
        super().__init__()
        if not 0 < num_layers or num_cp > num_layers:
            raise ConfigError(f"num_layers={num_layers}, num_cp={num_cp}: need num_layers >= 1 and "
                              "num_cp <= num_layers")
        self.num_layers = num_layers
        self.layers = nn.ModuleList(build_part(DeformableEncoderLayer, layer_cfg, "layer_cfg")
                                    for _ in range(num_layers))
        self.embed_dims = self.layers[0].embed_dims
        if num_cp > 0:
            from memfit.memory.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(self, [f"layers.{i}" for i in range(num_cp)])

    def forward(self, query: Tensor, query_pos: Tensor, key_padding_mask: Tensor | None,
                spatial_shapes: list[tuple[int, int]], valid_ratios: Tensor) -> Tensor:
        reference_points = self.reference_points(spatial_shapes, valid_ratios)
        for layer in self.layers:
            query = layer(query, query_pos, key_padding_mask, reference_points, spatial_shapes)
        return query

    @staticmethod
    def reference_points(spatial_shapes: list[tuple[int, int]], valid_ratios: Tensor) -> Tensor:
        """Pixel centres of every level, normalised by the valid (unpadded) size -> ``[B, S, levels, 2]``."""
        points = []
        for level, (h, w) in enumerate(spatial_shapes):
            ref_y, ref_x = torch.meshgrid(
                torch.linspace(0.5, h - 0.5, h, dtype=torch.float32, device=valid_ratios.device),
                torch.linspace(0.5, w - 0.5, w, dtype=torch.float32, device=valid_ratios.device), indexing="ij")
            ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, level, 1] * h)
            ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, level, 0] * w)
            points.append(torch.stack((ref_x, ref_y), -1))
        return torch.cat(points, 1)[:, :, None] * valid_ratios[:, None]


class MLP(nn.Module):
    """MMDetection's ``MLP``: ``num_layers`` linear layers with ReLU between them."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int) -> None:
        super().__init__()
        dims = [input_dim] + [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else layer(x).relu()
        return x


def inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    """``log(x / (1 - x))`` with ``x`` clamped to ``[eps, 1 - eps]`` (MMDetection's)."""
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class DINODecoder(nn.Module):
    """``num_layers`` decoder layers in ``self.layers`` with iterative box refinement.

    Each layer's query position comes from the sine embedding of its reference box (``ref_point_head``);
    after each layer ``reg_branches[i]`` refines the box. The next layer starts from the refined box
    detached, while the head predicts layer ``i`` from the box layer ``i`` started with *not* detached
    ("look forward twice"): :meth:`forward` returns the normed hidden states of every layer
    ``[layers, B, Q, C]`` and the references ``[layers + 1, B, Q, 4]`` (the initial one first).
    """

    def __init__(self, num_layers: int = 6, layer_cfg: dict | None = None, return_intermediate: bool = True,
                 post_norm_cfg: dict | None = None) -> None:
        super().__init__()
        if not return_intermediate:
            raise ConfigError("return_intermediate=False is not supported: DINO's head supervises every layer")
        if post_norm_cfg is not None:
            raise ConfigError("post_norm_cfg must be None: the decoder norms each layer's output itself")
        if num_layers < 1:
            raise ConfigError(f"num_layers={num_layers}: need at least 1")
        self.num_layers = num_layers
        self.layers = nn.ModuleList(build_part(DeformableDecoderLayer, layer_cfg, "layer_cfg")
                                    for _ in range(num_layers))
        self.embed_dims = self.layers[0].embed_dims
        self.ref_point_head = MLP(self.embed_dims * 2, self.embed_dims, self.embed_dims, 2)
        self.norm = nn.LayerNorm(self.embed_dims)

    def forward(self, query: Tensor, value: Tensor, key_padding_mask: Tensor | None, self_attn_mask: Tensor | None,
                reference_points: Tensor, spatial_shapes: list[tuple[int, int]], valid_ratios: Tensor,
                reg_branches: nn.ModuleList) -> tuple[Tensor, Tensor]:
        intermediate, references = [], [reference_points]
        for i, layer in enumerate(self.layers):
            ref_input = reference_points[:, :, None] * torch.cat([valid_ratios, valid_ratios], -1)[:, None]
            # the boxes stay fp32; their encoding enters the layers in the queries' dtype (whole-model bf16: bf16)
            encoding = coordinate_to_encoding(ref_input[:, :, 0, :], self.embed_dims // 2).to(query.dtype)
            query_pos = self.ref_point_head(encoding)
            query = layer(query, query_pos, value, key_padding_mask, self_attn_mask, ref_input, spatial_shapes)
            new_reference = (reg_branches[i](query) + inverse_sigmoid(reference_points, eps=1e-3)).sigmoid()
            reference_points = new_reference.detach()
            intermediate.append(self.norm(query))
            references.append(new_reference)
        return torch.stack(intermediate), torch.stack(references)
