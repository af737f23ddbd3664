"""DINO's losses (MMDetection's FocalLoss, L1Loss and GIoULoss configs), computed in fp32 under autocast.

The focal loss is torchvision's ``sigmoid_focal_loss`` (the same formula as MMCV's). The GIoU loss is our
own: torchvision's ``generalized_box_iou_loss`` indexes with a boolean mask (a data-dependent shape, which
fake tensors cannot run), so this is MMDetection's clamp-based formula, eps included. Each loss is a sum
divided by ``avg_factor`` (MMDetection's ``reduction='mean'`` with an average factor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import sigmoid_focal_loss

from memfit.errors import ConfigError
from memfit.model.detection.dino.config import pop_type
from memfit.model.detection.dino.fp32 import fp32_island


@dataclass(frozen=True)
class LossCfg:
    """A parsed loss config: its type, weight and (focal) alpha/gamma."""

    type: str
    loss_weight: float = 1.0
    alpha: float = 0.25
    gamma: float = 2.0
    eps: float = 1e-6


_SUPPORTED = {
    "loss_cls": ("FocalLoss", {"use_sigmoid", "gamma", "alpha", "loss_weight", "reduction", "activated"}),
    "loss_bbox": ("L1Loss", {"loss_weight", "reduction"}),
    "loss_iou": ("GIoULoss", {"loss_weight", "reduction", "eps"}),
}


def parse_loss(cfg: dict | None, name: str, key: str) -> LossCfg:
    """Check ``bbox_head.<name>`` (``loss_cls`` | ``loss_bbox`` | ``loss_iou``) and return its settings."""
    kind, allowed = _SUPPORTED[name]
    _, args = pop_type(cfg, key, (kind,), default=kind)
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ConfigError(f"{key}: {kind} takes no {unknown[0]!r} (valid: {', '.join(sorted(allowed))})")
    if args.get("use_sigmoid", True) is not True or args.get("activated", False):
        raise ConfigError(f"{key}: only the sigmoid focal loss on logits is supported (use_sigmoid=True)")
    if args.get("reduction", "mean") != "mean":
        raise ConfigError(f"{key}.reduction={args['reduction']!r} is not supported: use 'mean'")
    return LossCfg(kind, float(args.get("loss_weight", 1.0)), float(args.get("alpha", 0.25)),
                   float(args.get("gamma", 2.0)), float(args.get("eps", 1e-6)))


def focal_loss(logits: Tensor, labels: Tensor, avg_factor: Tensor | float, cfg: LossCfg) -> Tensor:
    """Sigmoid focal loss of ``logits`` ``[L, N, classes]`` against ``labels`` ``[L, N]`` (``classes`` =
    background: all-zero target), summed per layer and divided by ``avg_factor``, times ``loss_weight``: ``[L]``."""
    with fp32_island(logits.device):
        classes = logits.shape[-1]
        target = F.one_hot(labels, classes + 1)[..., :classes].float()
        loss = sigmoid_focal_loss(logits.float(), target, alpha=cfg.alpha, gamma=cfg.gamma, reduction="none")
        return cfg.loss_weight * loss.sum((1, 2)) / avg_factor


def l1_loss(pred: Tensor, target: Tensor, avg_factor: Tensor | float, cfg: LossCfg) -> Tensor:
    """``|pred - target|`` summed over each layer's matched boxes ``[L, n, 4]``, divided by ``avg_factor``: ``[L]``."""
    with fp32_island(pred.device):
        return cfg.loss_weight * (pred.float() - target.float()).abs().sum((1, 2)) / avg_factor


def giou_loss(pred: Tensor, target: Tensor, avg_factor: Tensor | float, cfg: LossCfg) -> Tensor:
    """``1 - GIoU`` of each layer's matched xyxy boxes ``[L, n, 4]`` (pixels), summed per layer and divided by
    ``avg_factor``: ``[L]``."""
    with fp32_island(pred.device):
        giou = aligned_giou(pred.float().reshape(-1, 4), target.float().reshape(-1, 4), cfg.eps)
        return cfg.loss_weight * (1 - giou).reshape(pred.shape[:2]).sum(1) / avg_factor


def aligned_giou(a: Tensor, b: Tensor, eps: float = 1e-6) -> Tensor:
    """GIoU of the pairs ``a[i]``, ``b[i]`` (xyxy ``[n, 4]``) -> ``[n]`` (MMDetection's ``bbox_overlaps``)."""
    lt, rb = torch.max(a[:, :2], b[:, :2]), torch.min(a[:, 2:], b[:, 2:])
    overlap = (rb - lt).clamp(min=0).prod(-1)
    union = ((a[:, 2:] - a[:, :2]).prod(-1) + (b[:, 2:] - b[:, :2]).prod(-1) - overlap).clamp(min=eps)
    enclose = (torch.max(a[:, 2:], b[:, 2:]) - torch.min(a[:, :2], b[:, :2])).clamp(min=0).prod(-1).clamp(min=eps)
    return overlap / union - (enclose - union) / enclose


def reduce_mean(value: Tensor) -> Tensor:
    """The mean of ``value`` over the ranks of the default process group (itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value.div_(dist.get_world_size()))
    return value


def avg_factor(count: int, device: torch.device, sync: bool) -> Tensor | float:
    """MMDetection's normaliser: the number of positives, averaged over ranks when ``sync``, at least 1.

    A python number on one process (no tensor op, no host sync); a tensor after the all-reduce."""
    import torch.distributed as dist

    if not sync or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(max(count, 1))
    return reduce_mean(torch.tensor(float(count), device=device)).clamp(min=1)
