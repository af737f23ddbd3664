"""``memfit data shapes-coco`` / write_shapes_coco: ShapesDataset written as a COCO dataset pycocotools reads."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision.io

from memfit.cli import main
from memfit.data import ShapesDataset, write_shapes_coco

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")


def test_annotation_file_matches_shapes_dataset(tmp_path):
    ann_file = write_shapes_coco(tmp_path, num=6, image_size=24, num_classes=2, max_shapes=3, seed=1, split="val")
    assert ann_file == tmp_path / "annotations" / "instances_val.json"
    coco = json.loads(ann_file.read_text())
    assert coco["categories"] == [dict(id=1, name="circle", supercategory="shape"),
                                  dict(id=2, name="square", supercategory="shape")]
    assert [im["file_name"] for im in coco["images"]] == [f"{i:06d}.png" for i in range(1, 7)]
    assert all(im["width"] == im["height"] == 24 for im in coco["images"])
    ref = ShapesDataset(num_samples=6, image_size=24, num_classes=2, max_shapes=3, seed=1, split="val")
    anns = coco["annotations"]
    assert [a["id"] for a in anns] == list(range(1, len(anns) + 1))
    for i in range(6):
        img, boxes, labels = ref.draw(i)
        mine = [a for a in anns if a["image_id"] == i + 1]
        assert [a["bbox"] for a in mine] == [[x1, y1, x2 - x1, y2 - y1] for x1, y1, x2, y2 in boxes.tolist()]
        assert [a["category_id"] for a in mine] == (labels + 1).tolist()
        assert all(a["area"] == a["bbox"][2] * a["bbox"][3] and a["iscrowd"] == 0 for a in mine)
        assert torch.equal(torchvision.io.decode_image(str(tmp_path / "val" / f"{i + 1:06d}.png")),
                           torch.from_numpy(img))


def test_cli_writes_both_splits_by_default(tmp_path, capsys):
    assert main(["data", "shapes-coco", "--out", str(tmp_path), "--num", "10", "--image-size", "16"]) == 0
    train = json.loads((tmp_path / "annotations" / "instances_train.json").read_text())
    val = json.loads((tmp_path / "annotations" / "instances_val.json").read_text())
    assert len(train["images"]) == 10 and len(val["images"]) == 2  # val: num // 5
    assert len(list((tmp_path / "train").glob("*.png"))) == 10 and len(list((tmp_path / "val").glob("*.png"))) == 2
    assert train["annotations"][:2] != val["annotations"][:2]  # independent streams of images
    assert "wrote 10 train images" in capsys.readouterr().out
    assert main(["data", "shapes-coco", "--out", str(tmp_path / "v"), "--num", "3", "--split", "val"]) == 0
    assert not (tmp_path / "v" / "train").exists() and len(list((tmp_path / "v" / "val").glob("*.png"))) == 3
    assert main(["data", "shapes-coco", "--out", str(tmp_path), "--num-classes", "11"]) == 2
    assert "num_classes=11 must be in [1, 10]" in capsys.readouterr().err
