"""Hungarian matching of predictions to ground truth (MMDetection's ``HungarianAssigner``).

The cost matrix is computed on the device in fp32; ``scipy.optimize.linear_sum_assignment`` solves it on
a CPU copy (the one host sync of the train step, inherent to DETR-style training, as in MMDetection).
On fake tensors (the planner's FakeTensorMode step) or meta tensors there are no values to match, so
query ``i`` is paired with target ``i`` for ``i < min(queries, targets)``: the same number of pairs as a
real assignment, hence the same shapes and memory in everything downstream.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torchvision.ops import box_convert, box_iou, generalized_box_iou

from memfit.errors import ConfigError
from memfit.model.detection.dino.config import pop_type
from memfit.model.detection.dino.fp32 import fp32_island

COST_TYPES = ("FocalLossCost", "BBoxL1Cost", "IoUCost")
_COST_KEYS = {
    "FocalLossCost": {"weight": 1.0, "alpha": 0.25, "gamma": 2.0, "eps": 1e-12, "binary_input": False},
    "BBoxL1Cost": {"weight": 1.0, "box_format": "xyxy"},
    "IoUCost": {"weight": 1.0, "iou_mode": "giou"},
}


def _parse_cost(cfg: dict, key: str) -> tuple[str, dict]:
    kind, args = pop_type(cfg, key, COST_TYPES)
    allowed = _COST_KEYS[kind]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise ConfigError(f"{key}: {kind} takes no {unknown[0]!r} (valid: {', '.join(allowed)})")
    args = {**allowed, **args}
    if args.get("binary_input"):
        raise ConfigError(f"{key}: binary_input=True is not supported (FocalLossCost on class logits only)")
    if args.get("box_format", "xywh") not in ("xyxy", "xywh"):
        raise ConfigError(f"{key}.box_format={args['box_format']!r}: use 'xywh' (cxcywh) or 'xyxy'")
    if args.get("iou_mode", "iou") not in ("iou", "giou"):
        raise ConfigError(f"{key}.iou_mode={args['iou_mode']!r}: use 'giou' or 'iou'")
    return kind, args


class HungarianAssigner:
    """One-to-one assignment minimising the weighted sum of ``match_costs`` (DINO's: FocalLossCost 2.0,
    BBoxL1Cost 5.0 on normalised cxcywh, IoUCost giou 2.0 on pixel boxes)."""

    def __init__(self, match_costs: list[dict] | None = None, key: str = "model.train_cfg.assigner") -> None:
        if match_costs is None:
            match_costs = [dict(type="FocalLossCost", weight=2.0),
                           dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
                           dict(type="IoUCost", iou_mode="giou", weight=2.0)]
        if isinstance(match_costs, dict):
            match_costs = [match_costs]
        self.costs = [_parse_cost(c, f"{key}.match_costs[{i}]") for i, c in enumerate(match_costs)]

    def cost(self, cls_logits: Tensor, boxes: Tensor, gt_labels: Tensor, gt_boxes: Tensor,
             img_shape: tuple[int, int]) -> Tensor:
        """The ``[..., queries, targets]`` cost: ``cls_logits`` ``[..., Q, classes]``, ``boxes`` ``[..., Q, 4]``
        normalised cxcywh (leading dims: decoder layers, costed at once), ``gt_boxes`` ``[n, 4]`` xyxy in
        ``img_shape`` pixels."""
        with fp32_island(cls_logits.device):
            cls_logits, boxes, gt_boxes = cls_logits.float(), boxes.float(), gt_boxes.float()
            h, w = img_shape
            factor = boxes.new_tensor([w, h, w, h])
            total = boxes.new_zeros(*boxes.shape[:-1], len(gt_boxes))
            for kind, args in self.costs:
                if kind == "FocalLossCost":
                    p = cls_logits.sigmoid()
                    neg = -(1 - p + args["eps"]).log() * (1 - args["alpha"]) * p.pow(args["gamma"])
                    pos = -(p + args["eps"]).log() * args["alpha"] * (1 - p).pow(args["gamma"])
                    c = pos[..., gt_labels] - neg[..., gt_labels]
                elif kind == "BBoxL1Cost":
                    gt_norm = gt_boxes / factor
                    if args["box_format"] == "xywh":
                        c = torch.cdist(boxes, box_convert(gt_norm, "xyxy", "cxcywh"), p=1)
                    else:
                        c = torch.cdist(box_convert(boxes, "cxcywh", "xyxy"), gt_norm, p=1)
                else:
                    pred = box_convert(boxes.reshape(-1, 4), "cxcywh", "xyxy") * factor
                    c = -(generalized_box_iou if args["iou_mode"] == "giou" else box_iou)(pred, gt_boxes)
                    c = c.reshape(total.shape)
                total = total + args["weight"] * c
            return total

    def assign(self, cls_logits: Tensor, boxes: Tensor, gt_labels: Tensor, gt_boxes: Tensor,
               img_shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Matched ``(query indices, target indices)``, ``min(Q, n)`` pairs, as long tensors on the device."""
        return self.assign_layers(cls_logits[None], boxes[None], gt_labels, gt_boxes, img_shape)[0]

    def assign_layers(self, cls_logits: Tensor, boxes: Tensor, gt_labels: Tensor, gt_boxes: Tensor,
                      img_shape: tuple[int, int]) -> list[tuple[Tensor, Tensor]]:
        """:meth:`assign` for each of ``L`` layers' ``[L, Q, classes]`` / ``[L, Q, 4]`` predictions of one image:
        their costs in one computation and one copy to the host."""
        device, n, layers = boxes.device, len(gt_labels), boxes.shape[0]
        if n == 0 or boxes.shape[1] == 0:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [(empty, empty)] * layers
        cost = self.cost(cls_logits.detach(), boxes.detach(), gt_labels, gt_boxes, img_shape)
        if isinstance(cost, FakeTensor) or cost.is_meta:
            k = torch.arange(min(boxes.shape[1], n), device=device)
            return [(k, k)] * layers
        out = []
        for layer_cost in cost.cpu().numpy():
            rows, cols = linear_sum_assignment(layer_cost)
            out.append((torch.as_tensor(rows, dtype=torch.long, device=device),
                        torch.as_tensor(cols, dtype=torch.long, device=device)))
        return out
