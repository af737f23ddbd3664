"""The image sizes a pipeline can output (memfit.data.sizes): every size a transform really makes is derived,
and the derived set holds nothing the transform cannot make where the draw is a finite choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from torchvision import tv_tensors

from memfit.config import Config
from memfit.data import build_transforms
from memfit.data import sizes as S
from memfit.data.det_transforms import build_det_pipeline

DINO = Path(__file__).parents[2] / "configs" / "detection" / "dino-5scale_swin-l_8xb2-12e_coco.py"


def _results(h: int, w: int) -> dict:
    boxes = torch.tensor([[1.0, 1.0, w - 1.0, h - 1.0]])
    return dict(img=tv_tensors.Image(torch.zeros(3, h, w, dtype=torch.uint8)), img_shape=(h, w), ori_shape=(h, w),
                scale_factor=(1.0, 1.0), gt_bboxes=tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w)),
                gt_bboxes_labels=torch.tensor([0]), gt_ignore_flags=torch.tensor([False]))


def _made(pipe, sizes, draws: int) -> set[tuple[int, int]]:
    """The output sizes of ``draws`` seeded runs of ``pipe`` over each input size."""
    out = set()
    for h, w in sizes:
        for seed in range(draws):
            torch.manual_seed(seed)
            r = pipe(_results(h, w))
            if r is not None:
                out.add(tuple((r["inputs"] if "inputs" in r else r["img"]).shape[-2:]))
    return out


def test_every_size_dinos_pipeline_makes_is_derived():
    """MMDetection's DINO augmentation (flip, RandomChoice of a multi-scale resize and a resize-crop-resize
    branch) on a landscape, a portrait and a square image."""
    steps = Config.fromfile(DINO).to_dict()["train_pipeline"]
    pipe = build_det_pipeline([s for s in steps if s["type"] not in ("LoadImageFromFile", "LoadAnnotations")])
    inputs = [(48, 64), (64, 40), (32, 32)]
    derived = {tuple(s) for s in pipe.output_sizes(np.asarray(inputs))}
    made = _made(pipe, inputs, 40)
    assert made <= derived
    # The resize branch alone: keep-ratio resizes to (1333, 800) of the 48x64 image is MMCV's 800x1067, of
    # the 64x40 portrait 1280x800 (factor min(1333 / 64, 800 / 40) = 20).
    assert {(800, 1067), (1280, 800)} <= derived and {(800, 1067), (1280, 800)} <= made
    # The crop branch reaches past 800 on a landscape image's short edge too: a 384x600 crop of a 600 px
    # resize, scaled by min(1333 / 600, 800 / 384) = 2.083, is 800x1250 (MMCV rounds half up).
    assert max(w for _, w in derived) == 1250 and (800, 1250) in derived
    assert max(h for h, _ in derived) == 1280


def test_random_resize_derives_exactly_the_scales_it_can_draw():
    """ratio_range: int(w * r), int(h * r) for r in [lo, hi) (MMCV's truncation): the derived set equals a
    dense sweep of r; two-bound form: every integer edge pair; keep_ratio goes through MMCV's rescale."""
    pipe = build_det_pipeline([dict(type="RandomResize", scale=(100, 50), ratio_range=(0.5, 1.0), keep_ratio=False)])
    swept = {(int(50 * r), int(100 * r)) for r in np.linspace(0.5, 1.0, 200001)[:-1]}
    derived = {tuple(s) for s in pipe.output_sizes(np.asarray([[30, 40]]))}
    assert derived - swept <= {(50, 100)} and swept <= derived  # r = hi itself is never drawn
    assert _made(pipe, [(30, 40)], 30) <= derived
    two = build_det_pipeline([dict(type="RandomResize", scale=[(60, 40), (64, 45)], keep_ratio=True)])
    assert len(two.transforms[0].scales()) == 5 * 6
    derived = {tuple(s) for s in two.output_sizes(np.asarray([[30, 40], [40, 30]]))}
    assert _made(two, [(30, 40), (40, 30)], 30) <= derived


def test_pad_and_crop_sizes():
    pipe = build_det_pipeline([dict(type="Pad", size_divisor=32)])
    r = pipe(_results(60, 80))
    assert r["img"].shape[-2:] == (64, 96) and r["img_shape"] == r["pad_shape"] == (64, 96)
    assert r["gt_bboxes"].tolist() == [[1, 1, 79, 59]] and r["gt_bboxes"].canvas_size == (64, 96)
    assert pipe.output_sizes(np.asarray([[60, 80]])).tolist() == [[64, 96]]
    square = build_det_pipeline([dict(type="Pad", pad_to_square=True, size_divisor=32)])
    assert square(_results(60, 80))["img"].shape[-2:] == (96, 96)
    fixed = build_det_pipeline([dict(type="Pad", size=(100, 70))])  # (w, h); never crops
    assert fixed(_results(60, 120))["img"].shape[-2:] == (70, 120)
    assert fixed.output_sizes(np.asarray([[60, 120]])).tolist() == [[70, 120]]
    crop = build_det_pipeline([dict(type="RandomCrop", crop_size=(0.5, 0.5), crop_type="relative_range",
                                    allow_negative_crop=True)])
    derived = {tuple(s) for s in crop.output_sizes(np.asarray([[20, 30]]))}
    assert derived == {(h, w) for h in range(10, 21) for w in range(15, 31)}
    assert _made(crop, [(20, 30)], 50) <= derived


def test_torchvision_resize_crop_rules_are_torchvisions():
    pipe = build_transforms([dict(type="Resize", size=100, max_size=150), dict(type="ToDtype", dtype="float32")])
    sizes = np.asarray([[60, 200], [200, 60], [90, 100]])
    derived = S.output_sizes(pipe, sizes).tolist()
    made = sorted(tuple(pipe(torch.zeros(3, h, w, dtype=torch.uint8)).shape[-2:]) for h, w in sizes.tolist())
    assert sorted(map(tuple, derived)) == made
    cls = build_transforms([dict(type="RandomResizedCrop", size=24), dict(type="RandomHorizontalFlip")])
    assert S.output_sizes(cls, sizes).tolist() == [[24, 24]]


def test_a_transform_without_a_rule_cannot_be_derived():
    def my_transform(results):
        return results

    pipe = build_det_pipeline([dict(type="RandomFlip", prob=0.5), my_transform])
    with pytest.raises(S.CannotDerive, match="my_transform does not say which image sizes it outputs"):
        pipe.output_sizes(np.asarray([[10, 10]]))
    with pytest.raises(S.CannotDerive, match="ElasticTransform"):
        S.output_sizes(T.Compose([T.ElasticTransform()]), np.asarray([[10, 10]]))
