"""MMDetection's transforms on tv_tensors: MMCV's sizes and rounding, boxes that stay on their pixels,
seeded randomness, the registry scheme that leaves classification pipelines on torchvision."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T
from torchvision import tv_tensors

from memfit.data import build_transforms
from memfit.data.det_resize import rescale_size
from memfit.data.det_transforms import build_det_pipeline
from memfit.errors import ConfigError


def _results(h: int = 60, w: int = 80, boxes=((10, 20, 50, 45),), labels=(1,), crowd=(False,)) -> dict:
    """A loaded sample: black image with each box drawn as a filled white rectangle."""
    img = torch.zeros(3, h, w, dtype=torch.uint8)
    for x1, y1, x2, y2 in boxes:
        img[:, y1:y2, x1:x2] = 255
    return dict(img=tv_tensors.Image(img), img_shape=(h, w), ori_shape=(h, w), scale_factor=(1.0, 1.0),
                flip=False, flip_direction=None, img_id=7, img_path="x.png",
                gt_bboxes=tv_tensors.BoundingBoxes(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                                                   format="XYXY", canvas_size=(h, w), clamping_mode=None),
                gt_bboxes_labels=torch.tensor(labels, dtype=torch.int64),
                gt_ignore_flags=torch.tensor(crowd, dtype=torch.bool))


def _drawn_box(img: torch.Tensor) -> list[int]:
    """The xyxy (max exclusive) box of the pixels brighter than mid-grey."""
    ys, xs = torch.nonzero(img[0] > 127, as_tuple=True)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


@pytest.mark.parametrize(
    ("size", "scale", "expected"),
    [
        ((640, 480), (1333, 800), (1067, 800)),  # short edge binds: 640 * 5/3 = 1066.67 -> 1067
        ((500, 375), (1333, 800), (1067, 800)),
        ((2000, 500), (1333, 800), (1333, 333)),  # long edge binds: 500 * 0.6665 = 333.25
        ((640, 427), (480, 1333), (719, 480)),  # DINO's first scale; (w, h) order does not matter
        ((5, 7), 0.5, (3, 4)),  # MMCV rounds half up (int(x + 0.5)); Python's round() would give (2, 4)
    ],
)
def test_rescale_size_is_mmcvs(size, scale, expected):
    assert rescale_size(size, scale)[0] == expected


def test_resize_keeps_ratio_scales_boxes_and_multiplies_scale_factor():
    pipe = build_det_pipeline([dict(type="Resize", scale=(1333, 800), keep_ratio=True),
                               dict(type="Resize", scale=(200, 100), keep_ratio=False)])
    r = build_det_pipeline([dict(type="Resize", scale=(1333, 800), keep_ratio=True)])(_results(480, 640))
    assert r["img"].shape == (3, 800, 1067) and r["img_shape"] == (800, 1067)
    assert r["scale_factor"] == (1067 / 640, 800 / 480)
    expected = torch.tensor([[10 * 1067 / 640, 20 * 800 / 480, 50 * 1067 / 640, 45 * 800 / 480]])
    torch.testing.assert_close(r["gt_bboxes"].as_subclass(torch.Tensor), expected)
    assert r["gt_bboxes"].canvas_size == (800, 1067)
    two = pipe(_results(480, 640))
    assert two["img"].shape == (3, 100, 200)
    assert two["scale_factor"] == pytest.approx((200 / 640, 100 / 480))  # cumulative: back to the loaded image


def test_random_choice_resize_draws_a_scale_with_torch_rng():
    pipe = build_det_pipeline([dict(type="RandomChoiceResize", scales=[(480, 1333), (512, 1333), (544, 1333)],
                                    keep_ratio=True)])
    heights = set()
    for seed in range(20):
        torch.manual_seed(seed)
        r = pipe(_results(427, 640))
        heights.add(r["img"].shape[-2])
        assert r["img"].shape[-2] == [480, 512, 544][r["scale_idx"]]
        torch.manual_seed(seed)
        assert pipe(_results(427, 640))["scale_idx"] == r["scale_idx"]  # seeded -> reproducible
    assert heights == {480, 512, 544}


@pytest.mark.parametrize("direction", ["horizontal", "vertical", "diagonal"])
def test_flip_moves_box_with_the_rectangle(direction):
    r = build_det_pipeline([dict(type="RandomFlip", prob=1.0, direction=direction)])(_results())
    assert r["flip"] is True and r["flip_direction"] == direction
    assert r["gt_bboxes"].tolist() == [_drawn_box(r["img"])]
    no = build_det_pipeline([dict(type="RandomFlip", prob=0.0)])(_results())
    assert no["flip"] is False and no["flip_direction"] is None and no["gt_bboxes"].tolist() == [[10, 20, 50, 45]]


def test_resize_flip_crop_keep_boxes_on_their_rectangles():
    pipe = build_det_pipeline([
        dict(type="RandomFlip", prob=0.5),
        dict(type="RandomChoiceResize", scales=[(90, 300), (130, 300)], keep_ratio=True, interpolation="nearest"),
        dict(type="RandomCrop", crop_type="absolute_range", crop_size=(40, 90), allow_negative_crop=True),
    ])
    checked = 0
    for seed in range(30):
        torch.manual_seed(seed)
        r = pipe(_results(60, 80, boxes=((10, 20, 50, 45),)))
        drawn = (r["img"][0] > 127).any()
        if len(r["gt_bboxes"]) and drawn:
            box = r["gt_bboxes"][0].tolist()
            assert all(abs(a - b) <= 1.0 for a, b in zip(box, _drawn_box(r["img"]))), (seed, box)
            checked += 1
        elif len(r["gt_bboxes"]):  # a sliver left by the crop, narrower than a pixel centre
            x1, y1, x2, y2 = r["gt_bboxes"][0].tolist()
            assert min(x2 - x1, y2 - y1) < 1
        else:
            assert not drawn  # the rectangle was cropped away with its box
    assert checked >= 10


def test_random_crop_clips_drops_empty_boxes_with_their_labels_and_can_skip():
    boxes = ((0, 0, 10, 10), (30, 30, 70, 50), (70, 5, 80, 15))
    r = _results(60, 80, boxes=boxes, labels=(0, 1, 2), crowd=(False, True, False))
    crop = build_det_pipeline([dict(type="RandomCrop", crop_size=(40, 40))])  # (h, w)
    torch.manual_seed(0)
    out = crop(dict(r))
    ch, cw = out["img"].shape[-2:]
    assert (ch, cw) == (40, 40) == out["img_shape"]
    kept = out["gt_bboxes"]
    assert ((kept[:, 0] >= 0) & (kept[:, 2] <= cw) & (kept[:, 1] >= 0) & (kept[:, 3] <= ch)).all()
    assert ((kept[:, 2] > kept[:, 0]) & (kept[:, 3] > kept[:, 1])).all()
    assert len(kept) == len(out["gt_bboxes_labels"]) == len(out["gt_ignore_flags"])
    lone = _results(60, 80, boxes=((0, 0, 5, 5),))
    skip = build_det_pipeline([dict(type="RandomCrop", crop_size=(10, 10))])
    results = []
    for seed in range(20):
        torch.manual_seed(seed)
        results.append(skip(dict(lone)))
    assert any(x is None for x in results)  # a crop with no box left skips the sample
    assert all(x is None or len(x["gt_bboxes"]) == 1 for x in results)


def test_random_choice_picks_a_branch_and_pack_splits_crowd_boxes():
    pipe = build_det_pipeline([
        dict(type="RandomChoice", prob=[0.0, 1.0], transforms=[
            [dict(type="Resize", scale=(10, 10))],
            [dict(type="Resize", scale=(40, 30)), dict(type="RandomFlip", prob=1.0)],
        ]),
        dict(type="PackDetInputs"),
    ])
    out = pipe(_results(60, 80, boxes=((0, 0, 8, 6), (40, 30, 80, 60)), labels=(2, 3), crowd=(False, True)))
    assert out["inputs"].shape == (3, 30, 40) and type(out["inputs"]) is torch.Tensor
    s = out["data_samples"]
    assert (s["img_id"], s["img_path"], s["ori_shape"], s["img_shape"]) == (7, "x.png", (60, 80), (30, 40))
    assert s["scale_factor"] == (0.5, 0.5) and s["flip"] is True and s["flip_direction"] == "horizontal"
    assert s["gt_instances"]["bboxes"].tolist() == [[36.0, 0.0, 40.0, 3.0]]
    assert s["gt_instances"]["labels"].tolist() == [2]
    assert s["ignored_instances"]["bboxes"].tolist() == [[0.0, 15.0, 20.0, 30.0]]
    assert s["ignored_instances"]["labels"].tolist() == [3]
    assert type(s["gt_instances"]["bboxes"]) is torch.Tensor and s["gt_instances"]["bboxes"].dtype == torch.float32


def test_filter_annotations_and_torchvision_fallback():
    r = _results(60, 80, boxes=((0, 0, 1, 5), (10, 10, 30, 30)), labels=(0, 1), crowd=(False, False))
    out = build_det_pipeline([dict(type="FilterAnnotations", min_gt_bbox_wh=(1.0, 1.0))])(r)
    assert out["gt_bboxes"].tolist() == [[10, 10, 30, 30]] and out["gt_bboxes_labels"].tolist() == [1]
    tiny = _results(boxes=((0, 0, 1, 1),))
    assert build_det_pipeline([dict(type="FilterAnnotations")])(tiny) is None
    # A name only torchvision has runs on the sample dict: the image changes, the boxes do not.
    jitter = build_det_pipeline([dict(type="ColorJitter", brightness=(0.5, 0.5))])(_results())
    assert jitter["img"].max() == 127 and jitter["gt_bboxes"].tolist() == [[10, 20, 50, 45]]


def test_names_resolve_mmdetection_first_and_classification_stays_torchvision():
    assert type(build_det_pipeline([dict(type="Resize", scale=(8, 8))]).transforms[0]).__module__.endswith(
        "det_resize")
    assert isinstance(build_transforms([dict(type="Resize", size=8)]).transforms[0], T.Resize)
    assert isinstance(build_transforms([dict(type="RandomCrop", size=8)]).transforms[0], T.RandomCrop)
    with pytest.raises(ConfigError, match=r"pipeline\[0\]: unknown transform type 'RandomFlipp': did you mean"):
        build_det_pipeline([dict(type="RandomFlipp", prob=0.5)])
    with pytest.raises(ConfigError, match=r"pipeline\[0\]: unknown key 'crop_sise': did you mean 'crop_size'"):
        build_det_pipeline([dict(type="RandomCrop", crop_sise=(1, 2))])
    with pytest.raises(ConfigError, match="crop_type='absolute_rang'.*did you mean 'absolute_range'"):
        build_det_pipeline([dict(type="RandomCrop", crop_size=(1, 2), crop_type="absolute_rang")])
