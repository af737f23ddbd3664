"""DINO's losses of every decoder layer at once equal torchvision's losses computed layer by layer."""

from __future__ import annotations

import torch
from torchvision.ops import box_convert, generalized_box_iou_loss, sigmoid_focal_loss

from memfit.model.detection.dino.head import DINOHead

CLASSES, LAYERS, QUERIES, GROUPS, MAX_GT = 3, 3, 6, 2, 4


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_dn = GROUPS * 2 * MAX_GT
    total = num_dn + QUERIES

    def boxes(*shape):
        centres = torch.rand(*shape, 2, generator=g) * 0.6 + 0.2
        return torch.cat([centres, torch.rand(*shape, 2, generator=g) * 0.3 + 0.05], -1)

    all_cls, all_boxes = torch.randn(LAYERS, 2, total, CLASSES, generator=g), boxes(LAYERS, 2, total)
    enc_cls, enc_boxes = torch.randn(2, QUERIES, CLASSES, generator=g), boxes(2, QUERIES)
    gts, shapes = [], [(48, 64), (64, 40)]
    for n, (h, w) in zip((4, 2), shapes):  # image 1 has fewer targets than the denoising groups' room
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w / 2, h / 2])
        gts.append(dict(bboxes=torch.cat([xy, xy + 4 + torch.rand(n, 2, generator=g) * 10], 1),
                        labels=torch.randint(0, CLASSES, (n,), generator=g)))
    dn_meta = dict(num_denoising_queries=num_dn, num_denoising_groups=GROUPS)
    return all_cls, all_boxes, enc_cls, enc_boxes, gts, shapes, dn_meta


def _layer(cls, boxes, gts, shapes, pairs):
    """One layer's (cls, bbox, iou) losses with torchvision's focal and GIoU losses."""
    num_pos = sum(len(r) for r, _ in pairs)
    labels = torch.full(cls.shape[:2], CLASSES)
    pred, target, factors = [], [], []
    for i, ((rows, cols), gt, (h, w)) in enumerate(zip(pairs, gts, shapes)):
        labels[i, rows] = gt["labels"][cols]
        pred.append(boxes[i, rows])
        target.append(gt["bboxes"][cols])
        factors.append(torch.tensor([w, h, w, h]).expand(len(rows), 4))
    pred, target, factors = torch.cat(pred), torch.cat(target), torch.cat(factors)
    onehot = torch.nn.functional.one_hot(labels, CLASSES + 1)[..., :CLASSES].float()
    cls_loss = sigmoid_focal_loss(cls, onehot, alpha=0.25, gamma=2.0, reduction="sum") / num_pos
    l1 = (pred - box_convert(target / factors, "xyxy", "cxcywh")).abs().sum() * 5.0 / num_pos
    giou = generalized_box_iou_loss(box_convert(pred, "cxcywh", "xyxy") * factors, target, reduction="sum",
                                    eps=1e-6) * 2.0 / num_pos
    return cls_loss, l1, giou


def test_every_layers_losses_at_once_equal_torchvisions_layer_by_layer():
    head = DINOHead(num_classes=CLASSES, embed_dims=8, num_pred_layer=LAYERS + 1)
    all_cls, all_boxes, enc_cls, enc_boxes, gts, shapes, dn_meta = _problem()
    losses = head.loss(all_cls, all_boxes, enc_cls, enc_boxes, gts, shapes, dn_meta)
    num_dn = dn_meta["num_denoising_queries"]
    expected = {}
    names = [f"d{i}." for i in range(LAYERS - 1)] + [""]
    for name, cls, boxes in [*((n, all_cls[i, :, num_dn:], all_boxes[i, :, num_dn:]) for i, n in enumerate(names)),
                             ("enc_", enc_cls, enc_boxes)]:
        pairs = [head.assigner.assign(cls[i], boxes[i], gt["labels"], gt["bboxes"], s)
                 for i, (gt, s) in enumerate(zip(gts, shapes))]
        values = _layer(cls, boxes, gts, shapes, pairs)
        expected.update(zip((f"{name}loss_{t}" for t in ("cls", "bbox", "iou")), values))
    per_group = num_dn // GROUPS
    dn_pairs = [((torch.arange(GROUPS)[:, None] * per_group + torch.arange(len(g["labels"]))).flatten(),
                 torch.arange(len(g["labels"])).repeat(GROUPS)) for g in gts]
    for i, name in enumerate(names):
        values = _layer(all_cls[i, :, :num_dn], all_boxes[i, :, :num_dn], gts, shapes, dn_pairs)
        expected.update(zip((f"{name}dn_loss_{t}" for t in ("cls", "bbox", "iou")), values))
    assert list(losses) == [k for k in losses if k in expected] and set(losses) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(losses[key], value, rtol=1e-6, atol=1e-6, msg=key)
    # the layers' matchings differ, so the check above compares per-layer assignments, not one shared one
    assert len({losses[f"{n}loss_cls"].item() for n in names}) == LAYERS
