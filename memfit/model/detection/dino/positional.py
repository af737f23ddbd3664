"""Sine positional encodings: of feature-map positions (the encoder's) and of box coordinates (the decoder's)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class SinePositionalEncoding(nn.Module):
    """MMDetection's ``SinePositionalEncoding`` (DETR's): sin/cos of the cumulative non-padding position.

    ``forward(mask, like)`` returns ``[B, 2 * num_feats, H, W]`` for a padding mask ``[B, H, W]`` (True on
    padding) or, with ``mask=None``, for an unpadded map shaped like ``like``. No parameters.
    """

    def __init__(self, num_feats: int = 128, temperature: int = 10000, normalize: bool = False,
                 scale: float = 2 * math.pi, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.num_feats, self.temperature, self.normalize = num_feats, temperature, normalize
        self.scale, self.eps, self.offset = scale, eps, offset

    def forward(self, mask: Tensor | None, like: Tensor) -> Tensor:
        if mask is None:
            b, _, h, w = like.shape
            not_mask = torch.ones(b, h, w, dtype=torch.float32, device=like.device)
        else:
            not_mask = (~mask).float()
        y_embed, x_embed = not_mask.cumsum(1), not_mask.cumsum(2)
        if self.normalize:
            y_embed = (y_embed + self.offset) / (y_embed[:, -1:, :] + self.eps) * self.scale
            x_embed = (x_embed + self.offset) / (x_embed[:, :, -1:] + self.eps) * self.scale
        dim_t = torch.arange(self.num_feats, dtype=torch.float32, device=not_mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_feats)
        pos_x, pos_y = _interleave(x_embed[..., None] / dim_t), _interleave(y_embed[..., None] / dim_t)
        return torch.cat((pos_y, pos_x), dim=-1).permute(0, 3, 1, 2)


def coordinate_to_encoding(coords: Tensor, num_feats: int = 128, temperature: int = 10000,
                           scale: float = 2 * math.pi) -> Tensor:
    """Sine embedding of normalised ``(x, y)`` or ``(cx, cy, w, h)`` coordinates ``[..., 2 | 4]`` ->
    ``[..., num_feats * 2 | 4]``, ordered y, x(, w, h) as MMDetection's ``coordinate_to_encoding``."""
    dim_t = torch.arange(num_feats, dtype=torch.float32, device=coords.device)
    dim_t = temperature ** (2 * (dim_t // 2) / num_feats)
    parts = [_interleave(coords[..., i, None] * scale / dim_t) for i in range(coords.shape[-1])]
    parts[0], parts[1] = parts[1], parts[0]  # y before x
    return torch.cat(parts, dim=-1)


def _interleave(pos: Tensor) -> Tensor:
    """``[..., n]`` -> sin of the even and cos of the odd entries, interleaved (DETR's layout)."""
    return torch.stack((pos[..., 0::2].sin(), pos[..., 1::2].cos()), dim=-1).flatten(-2)
