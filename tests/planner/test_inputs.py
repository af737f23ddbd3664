"""The batch the planner plans for (memfit.planner.inputs): the largest the train pipeline can make, with the
most boxes the annotations hold; sampled, and said so, where the sizes cannot be derived; or given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision.io

from memfit.config import Config
from memfit.errors import ConfigError
from memfit.planner.fake import fake_process_group, first_batch, measure_step
from memfit.planner.inputs import SAMPLED_BATCHES, Inputs

DINO = Path(__file__).parents[1] / "fixtures" / "detection" / "dino_tiny.py"
# (height, width, boxes) of each image: a landscape image with one box, a portrait one with three.
IMAGES = [(60, 80, 1), (80, 60, 3)]
# MMCV's keep-ratio resize to (300, 150) or (200, 100), drawn per image.
PIPELINE = [dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True),
            dict(type="RandomChoiceResize", scales=[(200, 100), (300, 150)], keep_ratio=True),
            dict(type="PackDetInputs")]


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    """A COCO-format dataset of :data:`IMAGES` (4 classes)."""
    root = tmp_path_factory.mktemp("coco")
    (root / "img").mkdir()
    (root / "annotations").mkdir()
    images, anns = [], []
    for i, (h, w, n) in enumerate(IMAGES, start=1):
        images.append(dict(id=i, file_name=f"{i}.png", height=h, width=w))
        torchvision.io.write_png(torch.randint(0, 255, (3, h, w), dtype=torch.uint8), str(root / "img" / f"{i}.png"))
        anns += [dict(id=len(anns) + 1, image_id=i, category_id=k % 4 + 1, bbox=[2 + 5 * k, 2, 4, 4], area=16,
                      iscrowd=0) for k in range(n)]
    cats = [dict(id=k, name=f"c{k}") for k in range(1, 5)]
    (root / "annotations" / "train.json").write_text(json.dumps(dict(images=images, annotations=anns,
                                                                     categories=cats)))
    return root


def _cfg(coco: Path, pipeline: list = PIPELINE, batch_size: int = 2, **over) -> dict:
    cfg = Config.fromfile(DINO).to_dict()
    cfg["train_dataloader"] = dict(batch_size=batch_size, num_workers=0, collate_fn=dict(type="pseudo_collate"),
                                   sampler=dict(type="DefaultSampler", shuffle=True),
                                   dataset=dict(type="CocoDataset", data_root=str(coco), data_prefix=dict(img="img/"),
                                                ann_file="annotations/train.json", pipeline=pipeline))
    cfg["optim_wrapper"] = dict(optimizer=dict(type="AdamW", lr=1e-4))
    return {**cfg, **over}


def test_plans_for_the_largest_batch_a_random_choice_resize_makes(coco):
    """Keep-ratio (300, 150): the 60x80 image becomes 150x200 (factor min(300 / 80, 150 / 60) = 2.5), the
    80x60 one 200x150. Two images of the batch pad to 200x200, then to the preprocessor's multiple of 32: 224x224.
    One image: either is 150x200 in area, padded 160x224. Boxes: the most one image holds (3)."""
    inputs = Inputs(_cfg(coco))
    two, one = inputs.planned(), inputs.planned(1)
    assert (two.shape, two.boxes_per_image, two.how) == ((2, 3, 224, 224), 3, "derived")
    assert not inputs.fixed_size  # two sizes: cuDNN's benchmark would tune each (memfit.planner.levers)
    assert one.shape in ((1, 3, 160, 224), (1, 3, 224, 160)) and one.boxes_per_image == 3
    batch = inputs.batch()
    assert [tuple(img.shape) for img in batch["inputs"]] == [(3, 200, 200)] * 2
    for sample in batch["data_samples"]:
        boxes, labels = sample["gt_instances"]["bboxes"], sample["gt_instances"]["labels"]
        assert sample["img_shape"] == (200, 200) and boxes.shape == (3, 4) and labels.shape == (3,)
        assert bool(((boxes[:, 2:] > boxes[:, :2]) & (boxes[:, 2:] <= 200) & (boxes >= 0).all(1, True)).all())
    # The first batch the loader makes is smaller: whatever it drew, its images are at most 200 px on a side.
    first = first_batch(_cfg(coco)["train_dataloader"])
    assert max(img.shape[-2] * img.shape[-1] for img in first["inputs"]) <= 200 * 150


def test_a_size_that_cannot_be_derived_is_sampled_and_said(coco):
    def shrink(results):  # a user's transform: no output_sizes rule
        results["img"] = results["img"][:, ::2, ::2]
        return results

    pipeline = [*PIPELINE[:3], shrink, PIPELINE[3]]
    inputs = Inputs(_cfg(coco, pipeline))
    planned = inputs.planned()
    assert planned.how == f"sampled {SAMPLED_BATCHES} batches" and "shrink does not say" in planned.why
    assert planned.describe().startswith("input 2x3x")
    assert "(sampled 8 batches: shrink does not say which image sizes it outputs)" in planned.describe()
    # Every sampled image is half of a resize's output: at most 100x100 from the 200x150/150x200 ones.
    assert planned.shape[2] <= 128 and planned.shape[3] <= 128 and planned.boxes_per_image == 3


def test_a_given_input_shape_overrides_and_bad_ones_are_one_line(coco):
    given = Inputs(_cfg(coco, planner=dict(input_shape="2x3x96x128")))
    assert given.planned().as_dict() == {"shape": [2, 3, 96, 128], "boxes_per_image": 3, "how": "given"}
    assert Inputs(_cfg(coco, planner=dict(input_shape=[70, 90]))).planned(1).shape == (1, 3, 96, 96)
    with pytest.raises(ConfigError, match=r"its batch 4 is not train_dataloader.batch_size=2: give HxW"):
        Inputs(_cfg(coco, planner=dict(input_shape="4x3x96x128")))
    with pytest.raises(ConfigError, match=r"planner.input_shape='2x3x96': give the image batch as BxCxHxW"):
        Inputs(_cfg(coco, planner=dict(input_shape="2x3x96")))
    with pytest.raises(ConfigError, match=r"planner: unknown key 'input_shap': did you mean 'input_shape'"):
        Inputs(_cfg(coco, planner=dict(input_shap="2x3x96x96")))


def test_the_fake_step_runs_the_worst_batch_and_its_matching_sees_every_box(coco, monkeypatch):
    """DINO's Hungarian matching on fake tensors pairs min(queries, boxes) of each image: called with the
    annotations' most boxes for both images (the loader's batches hold the two images, with 1 and 3 boxes)."""
    from memfit.model.detection.dino.matcher import HungarianAssigner

    seen = []
    assign = HungarianAssigner.assign_layers
    monkeypatch.setattr(HungarianAssigner, "assign_layers",
                        lambda self, logits, boxes, labels, *a: seen.append(len(labels)) or assign(self, logits,
                                                                                                  boxes, labels, *a))
    with fake_process_group(1):
        measure_step(_cfg(coco), full=False)
    assert len(seen) >= 2 and set(seen) == {3}
