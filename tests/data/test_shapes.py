"""ShapesDataset: deterministic, well-formed, boxes tight, and learnable by a tiny CNN."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from memfit.data import ShapesDataset, build_dataloader
from memfit.data.shapes import SHAPES
from memfit.errors import ConfigError
from memfit.registry import DATASETS


def test_item_format_and_default_transform():
    item = ShapesDataset(num_samples=4, image_size=32)[1]
    assert set(item) == {"img", "label", "boxes", "labels"}
    assert item["img"].shape == (3, 32, 32) and item["img"].dtype == torch.float32
    assert -1 <= item["img"].min() and item["img"].max() <= 1
    assert isinstance(item["label"], int) and item["labels"].tolist() == [item["label"]]
    assert item["boxes"].shape == (1, 4) and item["boxes"].dtype == torch.float32
    raw = ShapesDataset(num_samples=4, image_size=32, transform=[])[1]["img"]
    assert raw.dtype == torch.uint8
    assert torch.allclose(raw.float() / 127.5 - 1, item["img"], atol=1e-6)


def test_deterministic_per_seed_split_index():
    a, b = ShapesDataset(num_samples=10, transform=[]), ShapesDataset(num_samples=10, transform=[])
    assert all(torch.equal(a[i]["img"], b[i]["img"]) for i in range(10))
    assert torch.equal(a[3]["img"], a[3]["img"])
    assert not torch.equal(a[3]["img"], a[4]["img"])
    for other in (
        ShapesDataset(num_samples=10, split="val", transform=[]),
        ShapesDataset(10, seed=1, transform=[]),
    ):
        assert not torch.equal(a[3]["img"], other[3]["img"])


def test_classes_balanced_and_named():
    ds = ShapesDataset(num_samples=2000, num_classes=10, image_size=16, transform=[])
    counts = np.bincount([ds.draw(i)[2][0] for i in range(2000)], minlength=10)
    assert counts.min() > 150  # expected 200 each
    assert ds.metainfo["classes"] == tuple(SHAPES)


def test_box_is_tight_around_the_shape():
    """Inside the box the shape's pixels differ from the background; outside, only noise."""
    ds = ShapesDataset(num_samples=50, image_size=64, num_classes=10, transform=[])
    for i in range(50):
        img, boxes, _ = ds.draw(i)
        x0, y0, x1, y1 = boxes[0].astype(int)
        gray = img.astype(np.float32).mean(0)
        background = np.median(gray[:, :2])  # ~background (shapes keep a margin from the edge)
        far = np.abs(gray - background) > 60  # far beyond the noise (sigma 12)
        ys, xs = np.nonzero(far)
        assert ys.min() == y0 and ys.max() + 1 == y1 and xs.min() == x0 and xs.max() + 1 == x1


def test_distractors_for_detection_do_not_overlap():
    ds = ShapesDataset(num_samples=200, image_size=64, num_classes=6, max_shapes=4, transform=[])
    counts = []
    for i in range(200):
        item = ds[i]
        boxes, labels = item["boxes"], item["labels"]
        counts.append(len(labels))
        assert len(boxes) == len(labels) and labels[0] == item["label"]
        assert (
            (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 64).all() and (boxes[:, 2:] > boxes[:, :2]).all()
        )
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                inter = (
                    torch.minimum(boxes[a, 2:], boxes[b, 2:]) - torch.maximum(boxes[a, :2], boxes[b, :2])
                ).clamp(0)
                assert inter.prod() == 0
    assert min(counts) == 1 and max(counts) == 4


def test_tiny_canvas_always_has_the_main_shape():
    ds = ShapesDataset(num_samples=500, image_size=8, num_classes=10, transform=[])
    assert all(ds.draw(i)[1].shape == (1, 4) for i in range(500))


def test_config_errors():
    with pytest.raises(ConfigError, match=r"num_classes=11 must be in \[1, 10\]"):
        ShapesDataset(num_classes=11)
    with pytest.raises(ConfigError, match="image_size=4"):
        ShapesDataset(image_size=4)
    with pytest.raises(ConfigError, match="unknown key 'num_sample'.*'num_samples'"):
        DATASETS.build(dict(type="ShapesDataset", num_sample=4))
    with pytest.raises(IndexError):
        ShapesDataset(num_samples=3)[3]


def test_a_tiny_cnn_learns_it():
    """100 Adam steps of a 3-conv net on 32 px shapes beat chance (25%) by far on the val split (~98%)."""
    torch.manual_seed(0)
    train = ShapesDataset(num_samples=3200, image_size=32, num_classes=4, split="train")
    val = ShapesDataset(num_samples=512, image_size=32, num_classes=4, split="val")

    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

    net = nn.Sequential(
        *block(3, 16), *block(16, 32), *block(32, 64), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(64, 4)
    )
    opt = torch.optim.Adam(net.parameters(), 3e-3)
    for batch in build_dataloader(dict(batch_size=32, dataset=train), seed=0):
        loss = nn.functional.cross_entropy(net(batch["img"]), torch.as_tensor(batch["label"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    vb = next(iter(build_dataloader(dict(batch_size=512, dataset=val), seed=0)))
    with torch.no_grad():
        acc = (net(vb["img"]).argmax(1) == vb["label"]).float().mean().item()
    print(f"val accuracy {acc:.3f}")
    assert acc > 0.7, acc
