"""Contrastive denoising (CDN) queries of DINO: noised ground-truth boxes and labels fed to the decoder in
training, with the attention mask that keeps the denoising groups and the matching queries apart.

Sizes come from ``len(labels)`` (python ints), never from tensor values, so the train step runs on fake
tensors; labels are noised with ``torch.where`` rather than MMDetection's ``nonzero`` (same distribution,
no data-dependent shape).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchvision.ops import box_convert

from memfit.errors import ConfigError, did_you_mean
from memfit.model.detection.dino.transformer import inverse_sigmoid

GROUP_KEYS = ("dynamic", "num_groups", "num_dn_queries")


class CdnQueryGenerator(nn.Module):
    """MMDetection's ``CdnQueryGenerator``. ``group_cfg=dict(dynamic=True, num_dn_queries=100)`` makes
    ``num_dn_queries // max targets per image`` groups (at least 1), ``dynamic=False`` uses ``num_groups``.
    Each group holds a positive (small noise: to be reconstructed) and a negative (larger noise: to be
    classified as background) copy of every target. ``label_embedding`` embeds the noised labels."""

    def __init__(self, num_classes: int, embed_dims: int, num_matching_queries: int, label_noise_scale: float = 0.5,
                 box_noise_scale: float = 1.0, group_cfg: dict | None = None) -> None:
        super().__init__()
        group_cfg = dict(group_cfg or {})
        for k in group_cfg:
            if k not in GROUP_KEYS:
                raise ConfigError(f"group_cfg: unknown key {k!r}: {did_you_mean(k, GROUP_KEYS)}")
        if label_noise_scale <= 0 or box_noise_scale <= 0:
            raise ConfigError(f"label_noise_scale={label_noise_scale}, box_noise_scale={box_noise_scale}: "
                              "both must be > 0")
        self.dynamic = bool(group_cfg.get("dynamic", True))
        self.num_dn_queries = group_cfg.get("num_dn_queries", 100)
        self.num_groups = group_cfg.get("num_groups")
        if self.dynamic and not (isinstance(self.num_dn_queries, int) and self.num_dn_queries > 0):
            raise ConfigError(f"group_cfg.num_dn_queries={self.num_dn_queries!r}: dynamic groups need a positive int")
        if not self.dynamic and not (isinstance(self.num_groups, int) and self.num_groups > 0):
            raise ConfigError(f"group_cfg.num_groups={self.num_groups!r}: dynamic=False needs a positive int")
        self.num_classes, self.embed_dims = num_classes, embed_dims
        self.num_matching_queries = num_matching_queries
        self.label_noise_scale, self.box_noise_scale = label_noise_scale, box_noise_scale
        self.label_embedding = nn.Embedding(num_classes, embed_dims)

    def groups(self, max_num_target: int) -> int:
        """The number of denoising groups for a batch whose largest image has ``max_num_target`` targets."""
        if not self.dynamic:
            return self.num_groups
        return max(1, self.num_dn_queries // max_num_target) if max_num_target else 1

    def forward(self, gt_labels: list[Tensor], gt_bboxes: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, dict]:
        """``gt_labels[i]`` ``[n_i]`` and ``gt_bboxes[i]`` ``[n_i, 4]`` (xyxy normalised by the image size) ->
        label queries ``[B, Nd, C]``, box queries ``[B, Nd, 4]`` (inverse-sigmoid cxcywh), the self-attention
        mask ``[Nd + Q, Nd + Q]`` (True: may not attend) and ``dn_meta``. ``Nd = 2 * groups * max n_i``:
        image ``i``'s group ``g`` holds its positives at ``2 g max + [0, n_i)`` and negatives ``max`` later."""
        counts = [len(labels) for labels in gt_labels]
        max_t, b = max(counts, default=0), len(counts)
        groups = self.groups(max_t)
        device = self.label_embedding.weight.device
        labels = torch.cat(gt_labels).to(device)
        boxes = torch.cat(gt_bboxes).to(device)
        total = len(labels)
        label_query = self.label_embedding(self._noisy_labels(labels.repeat(2 * groups)))
        box_query = self._noisy_boxes(boxes, groups)
        # Scatter (copy k of every target) to its slot; copies run [pos g0, neg g0, pos g1, ...].
        num_dn = 2 * groups * max_t
        image = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.long, device=device)
        slot = torch.tensor([j for n in counts for j in range(n)], dtype=torch.long, device=device)
        copies = torch.arange(2 * groups, device=device).repeat_interleave(total) * max_t
        rows, cols = image.repeat(2 * groups), slot.repeat(2 * groups) + copies
        batched_labels = label_query.new_zeros(b, num_dn, self.embed_dims).index_put((rows, cols), label_query)
        batched_boxes = label_query.new_zeros(b, num_dn, 4).index_put((rows, cols), box_query.to(label_query.dtype))
        return batched_labels, batched_boxes, self.attn_mask(max_t, groups, device), dict(
            num_denoising_queries=num_dn, num_denoising_groups=groups)

    def _noisy_labels(self, labels: Tensor) -> Tensor:
        """A share ``label_noise_scale / 2`` of the labels replaced by random classes."""
        flip = torch.rand(labels.shape, device=labels.device) < self.label_noise_scale * 0.5
        return torch.where(flip, torch.randint_like(labels, 0, self.num_classes), labels)

    def _noisy_boxes(self, boxes: Tensor, groups: int) -> Tensor:
        """Corners moved by up to ``box_noise_scale / 2`` of the box size (positives) or between that and
        twice it (negatives), in random directions; returned as inverse-sigmoid cxcywh ``[2 G n, 4]``."""
        total = len(boxes)
        expanded = boxes.repeat(2 * groups, 1)  # [pos g0 | neg g0 | pos g1 | ...], each ``total`` rows
        negative = (torch.arange(2 * groups, device=boxes.device) % 2).repeat_interleave(total)[:, None]
        sign = torch.randint_like(expanded, 0, 2) * 2.0 - 1.0
        part = (torch.rand_like(expanded) + negative) * sign  # pos: (-1, 1); neg: (-2, -1] U [1, 2)
        whwh = box_convert(expanded, "xyxy", "cxcywh")[:, 2:].repeat(1, 2)
        noisy = (expanded + part * whwh * self.box_noise_scale / 2).clamp(0.0, 1.0)
        return inverse_sigmoid(box_convert(noisy, "xyxy", "cxcywh"), eps=1e-3)

    def attn_mask(self, max_num_target: int, groups: int, device: torch.device) -> Tensor:
        """True where a query may not attend: matching queries never see denoising queries, and each
        denoising group sees only itself (and the matching queries)."""
        num_dn = 2 * groups * max_num_target
        size = num_dn + self.num_matching_queries
        mask = torch.zeros(size, size, dtype=torch.bool, device=device)
        if num_dn:
            group = torch.arange(num_dn, device=device) // (2 * max_num_target)
            mask[:num_dn, :num_dn] = group[:, None] != group[None, :]
            mask[num_dn:, :num_dn] = True
        return mask
