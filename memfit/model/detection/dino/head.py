"""DINOHead: per-layer class and box branches, DINO's losses (matching, encoder proposals, denoising) and
the top-k decoding of predictions. Parameter names are MMDetection's (``cls_branches.<i>``, ``reg_branches.<i>``).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn
from torchvision.ops import box_convert

from memfit.errors import ConfigError
from memfit.model.detection.dino.losses import avg_factor, focal_loss, giou_loss, l1_loss, parse_loss
from memfit.model.detection.dino.matcher import HungarianAssigner
from memfit.model.detection.dino.transformer import inverse_sigmoid
from memfit.registry import MODELS


@MODELS.register()
class DINOHead(nn.Module):
    """``num_pred_layer`` copies of the branches (one per decoder layer, plus one for the encoder proposals
    as in MMDetection's two-stage DINO): ``cls`` a Linear to ``num_classes`` sigmoid logits, ``reg`` an MLP
    (``num_reg_fcs`` hidden Linear+ReLU) to a box offset in inverse-sigmoid space.

    Losses (MMDetection's keys): ``loss_cls/bbox/iou`` of the last layer, ``d<i>.loss_*`` of the others,
    ``enc_loss_*`` of the encoder's top-k proposals, ``dn_loss_*`` / ``d<i>.dn_loss_*`` of the denoising
    queries; the class loss is averaged over the positives (over ranks with ``sync_cls_avg_factor``).
    """

    def __init__(self, num_classes: int, embed_dims: int = 256, num_reg_fcs: int = 2,
                 sync_cls_avg_factor: bool = False, loss_cls: dict | None = None, loss_bbox: dict | None = None,
                 loss_iou: dict | None = None, num_pred_layer: int = 7, train_cfg: dict | None = None,
                 test_cfg: dict | None = None) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ConfigError(f"num_classes={num_classes!r}: need a positive int")
        self.num_classes, self.embed_dims, self.sync_cls_avg_factor = num_classes, embed_dims, sync_cls_avg_factor
        self.loss_cls = parse_loss(loss_cls or dict(type="FocalLoss"), "loss_cls", "loss_cls")
        self.loss_bbox = parse_loss(loss_bbox or dict(type="L1Loss", loss_weight=5.0), "loss_bbox", "loss_bbox")
        self.loss_iou = parse_loss(loss_iou or dict(type="GIoULoss", loss_weight=2.0), "loss_iou", "loss_iou")
        train_cfg = dict(train_cfg or {})
        assigner = dict(train_cfg.pop("assigner", None) or dict(type="HungarianAssigner"))
        if train_cfg:
            raise ConfigError(f"model.train_cfg: unknown key {next(iter(train_cfg))!r} (valid: 'assigner')")
        if assigner.pop("type", "HungarianAssigner") != "HungarianAssigner" or set(assigner) - {"match_costs"}:
            raise ConfigError("model.train_cfg.assigner: only dict(type='HungarianAssigner', match_costs=[...]) "
                              "is supported")
        self.assigner = HungarianAssigner(assigner.get("match_costs"))
        test_cfg = dict(test_cfg or {})
        self.max_per_img = test_cfg.pop("max_per_img", 100)
        if test_cfg:
            raise ConfigError(f"model.test_cfg: unknown key {next(iter(test_cfg))!r} (valid: 'max_per_img')")

        cls = nn.Linear(embed_dims, num_classes)
        reg = []
        for _ in range(num_reg_fcs):
            reg += [nn.Linear(embed_dims, embed_dims), nn.ReLU()]
        reg = nn.Sequential(*reg, nn.Linear(embed_dims, 4))
        self.cls_branches = nn.ModuleList(copy.deepcopy(cls) for _ in range(num_pred_layer))
        self.reg_branches = nn.ModuleList(copy.deepcopy(reg) for _ in range(num_pred_layer))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """MMDetection's: class biases at prior probability 0.01, zero last box layer."""
        for m in self.cls_branches:
            nn.init.constant_(m.bias, -math.log((1 - 0.01) / 0.01))
        for m in self.reg_branches:
            nn.init.zeros_(m[-1].weight)
            nn.init.zeros_(m[-1].bias)

    def forward(self, hidden_states: Tensor, references: Tensor) -> tuple[Tensor, Tensor]:
        """``hidden_states`` ``[L, B, Q, C]`` and ``references`` ``[L + 1, B, Q, 4]`` (sigmoid cxcywh) ->
        class logits ``[L, B, Q, classes]`` and boxes ``[L, B, Q, 4]`` (normalised cxcywh). Layer ``i``
        refines the box it started from, ``references[i]``."""
        classes, coords = [], []
        for i in range(hidden_states.shape[0]):
            classes.append(self.cls_branches[i](hidden_states[i]))
            coords.append((self.reg_branches[i](hidden_states[i]) + inverse_sigmoid(references[i])).sigmoid())
        return torch.stack(classes), torch.stack(coords)

    # ---- losses -------------------------------------------------------------------------------------
    # Every decoder layer's losses are computed together ([L, ...] tensors, one loss value per layer): the
    # same values as layer by layer, in a third of the loss's operators (fewer kernel launches on a GPU,
    # 3 all-reduces of the positives' count a step instead of 13, and a faster fake step for the planner).
    def loss(self, all_cls: Tensor, all_boxes: Tensor, enc_cls: Tensor, enc_boxes: Tensor,
             gts: list[dict], img_shapes: list[tuple[int, int]], dn_meta: dict | None) -> dict[str, Tensor]:
        """All DINO losses. ``gts[i]``: ``dict(bboxes=[n, 4] xyxy pixels, labels=[n])``; the first
        ``dn_meta['num_denoising_queries']`` queries of ``all_cls``/``all_boxes`` are the denoising ones."""
        num_dn = dn_meta["num_denoising_queries"] if dn_meta else 0
        layers = all_cls.shape[0]
        names = [f"d{i}." for i in range(layers - 1)] + [""]
        losses: dict[str, Tensor] = {}
        self._add(losses, names, "", self._matched(all_cls[:, :, num_dn:], all_boxes[:, :, num_dn:], gts, img_shapes))
        self._add(losses, ["enc_"], "", self._matched(enc_cls[None], enc_boxes[None], gts, img_shapes))
        if num_dn:
            self._add(losses, names, "dn_", self._denoising(all_cls[:, :, :num_dn], all_boxes[:, :, :num_dn],
                                                            gts, img_shapes, dn_meta))
        return losses

    @staticmethod
    def _add(losses: dict, names: list[str], kind: str, values: tuple[Tensor, Tensor, Tensor]) -> None:
        for i, name in enumerate(names):
            for term, value in zip(("cls", "bbox", "iou"), values):
                losses[f"{name}{kind}loss_{term}"] = value[i]

    def _matched(self, cls: Tensor, boxes: Tensor, gts: list[dict], img_shapes: list[tuple[int, int]]
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-layer losses of ``cls`` ``[L, B, Q, classes]`` / ``boxes`` ``[L, B, Q, 4]`` after Hungarian
        matching of each layer."""
        per_image = [self.assigner.assign_layers(cls[:, i], boxes[:, i], gt["labels"], gt["bboxes"], shape)
                     for i, (gt, shape) in enumerate(zip(gts, img_shapes))]
        pairs = [[per_image[i][layer] for i in range(len(gts))] for layer in range(cls.shape[0])]
        return self._targets_loss(cls, boxes, gts, img_shapes, pairs)

    def _denoising(self, cls: Tensor, boxes: Tensor, gts: list[dict], img_shapes: list[tuple[int, int]],
                   dn_meta: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Per-layer losses of the denoising queries: group ``g``'s positive copy of target ``j`` sits at
        ``g * 2 * max + j`` and must reconstruct it; every other denoising query is background."""
        groups = dn_meta["num_denoising_groups"]
        per_group = cls.shape[2] // groups
        pairs = []
        for gt in gts:
            t = torch.arange(len(gt["labels"]), device=cls.device)
            offsets = torch.arange(groups, device=cls.device)[:, None] * per_group
            pairs.append(((offsets + t).flatten(), t.repeat(groups)))
        return self._targets_loss(cls, boxes, gts, img_shapes, [pairs] * cls.shape[0])

    def _targets_loss(self, cls: Tensor, boxes: Tensor, gts: list[dict], img_shapes: list[tuple[int, int]],
                      pairs: list[list[tuple[Tensor, Tensor]]]) -> tuple[Tensor, Tensor, Tensor]:
        """Focal loss over all queries (unmatched ones: background), L1 (normalised cxcywh) and GIoU (pixels)
        over the matched pairs, per layer: ``pairs[layer][image]`` = (query indices, target indices).
        Every layer has as many pairs (matching pairs min(Q, n) per image; denoising the same for all)."""
        device = cls.device
        layers, b, q, _ = cls.shape
        num_pos = sum(len(rows) for rows, _ in pairs[0])  # python int: known from the shapes, also on fake tensors
        starts = [0]
        for g in gts:
            starts.append(starts[-1] + len(g["labels"]))
        # Flat indices: a query into [L * B * Q], a target into the batch's targets concatenated.
        queries = torch.cat([rows + (layer * b + i) * q for layer, per in enumerate(pairs)
                             for i, (rows, _) in enumerate(per)])
        targets = torch.cat([cols + starts[i] for per in pairs for i, (_, cols) in enumerate(per)])
        gt_labels = torch.cat([g["labels"].to(device) for g in gts])
        gt_xyxy = torch.cat([g["bboxes"].to(device).float() for g in gts])
        gt_factors = torch.tensor([[w, h, w, h] for (h, w), g in zip(img_shapes, gts) for _ in range(len(g["labels"]))],
                                  dtype=torch.float32, device=device).reshape(-1, 4)
        labels = torch.full((layers * b * q,), self.num_classes, dtype=torch.long, device=device)
        labels = labels.index_put((queries,), gt_labels[targets])
        target_xyxy, factors = gt_xyxy[targets], gt_factors[targets]
        pred = boxes.reshape(-1, 4)[queries]
        loss_cls = focal_loss(cls.reshape(layers, b * q, self.num_classes), labels.reshape(layers, b * q),
                              avg_factor(num_pos, device, self.sync_cls_avg_factor), self.loss_cls)
        box_avg = avg_factor(num_pos, device, True)
        per_layer = (layers, num_pos, 4)
        target_cxcywh = box_convert(target_xyxy / factors, "xyxy", "cxcywh")
        loss_bbox = l1_loss(pred.reshape(per_layer), target_cxcywh.reshape(per_layer), box_avg, self.loss_bbox)
        loss_iou = giou_loss((box_convert(pred.float(), "cxcywh", "xyxy") * factors).reshape(per_layer),
                             target_xyxy.reshape(per_layer), box_avg, self.loss_iou)
        return loss_cls, loss_bbox, loss_iou

    # ---- prediction ---------------------------------------------------------------------------------
    def predict(self, cls: Tensor, boxes: Tensor, samples: list[dict]) -> list[dict]:
        """Top ``max_per_img`` (query, class) pairs per image from the last layer's ``cls`` ``[B, Q, classes]``
        and ``boxes`` ``[B, Q, 4]``; boxes in original-image pixels (divided by ``scale_factor``), clipped."""
        results = []
        for i, sample in enumerate(samples):
            scores = cls[i].float().sigmoid().flatten()
            top, index = scores.topk(min(self.max_per_img, scores.numel()))
            labels, query = index % self.num_classes, index // self.num_classes
            h, w = sample.get("img_shape", sample.get("batch_input_shape"))
            xyxy = box_convert(boxes[i, query].float(), "cxcywh", "xyxy")
            xyxy = xyxy * xyxy.new_tensor([w, h, w, h])
            xyxy[:, 0::2] = xyxy[:, 0::2].clamp(0, w)
            xyxy[:, 1::2] = xyxy[:, 1::2].clamp(0, h)
            sx, sy = sample.get("scale_factor", (1.0, 1.0))
            xyxy = xyxy / xyxy.new_tensor([sx, sy, sx, sy])
            h0, w0 = sample.get("ori_shape", (h / sy, w / sx))
            xyxy[:, 0::2] = xyxy[:, 0::2].clamp(0, w0)
            xyxy[:, 1::2] = xyxy[:, 1::2].clamp(0, h0)
            results.append(dict(img_id=sample.get("img_id"), ori_shape=(h0, w0),
                                pred_instances=dict(bboxes=xyxy, scores=top, labels=labels.long())))
        return results
