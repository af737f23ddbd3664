"""CocoDataset: MMDetection's config and parsing (xywh -> xyxy, invalid and crowd boxes, class subsets,
filter_cfg), one-line errors, refetching skipped samples, seeded loading through build_dataloader."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision.io

from memfit.data import CocoDataset, ShapesDataset, build_dataloader, write_shapes_coco
from memfit.errors import ConfigError

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec, which memfit does not depend on.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
LOAD = [dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True)]
PACK = [*LOAD, dict(type="PackDetInputs")]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes_coco")
    write_shapes_coco(root, num=12, image_size=32, num_classes=3, max_shapes=3, seed=4, split="train")
    return root


@pytest.fixture
def hand_made(tmp_path):
    """Four images (one 20 px wide) and annotations that exercise every parsing rule."""
    images = [dict(id=i, file_name=f"{i}.png", width=40 if i != 4 else 20, height=30) for i in (1, 2, 3, 4)]
    anns = [
        dict(bbox=[2, 3, 10, 5], category_id=5, iscrowd=0, area=50, image_id=1),  # dog
        dict(bbox=[20, 10, 8, 8], category_id=9, iscrowd=1, area=64, image_id=1),  # crowd cat -> ignored
        dict(bbox=[0, 0, 0.5, 8], category_id=5, iscrowd=0, area=4, image_id=1),  # w < 1: skipped
        dict(bbox=[1, 1, 4, 4], category_id=5, iscrowd=0, area=0, image_id=1),  # zero area: skipped
        dict(bbox=[45, 0, 5, 5], category_id=5, iscrowd=0, area=25, image_id=1),  # outside: skipped
        dict(bbox=[1, 1, 6, 6], category_id=9, iscrowd=0, area=36, image_id=2),  # cat
        dict(bbox=[1, 1, 6, 6], category_id=9, iscrowd=1, area=36, image_id=3),  # crowd only
        dict(bbox=[1, 1, 6, 6], category_id=5, iscrowd=0, area=36, image_id=4),  # on the narrow image
    ]
    for k, a in enumerate(anns):
        a["id"] = k + 1
    cats = [dict(id=9, name="cat"), dict(id=5, name="dog"), dict(id=7, name="bird")]
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "inst.json").write_text(json.dumps(dict(images=images, annotations=anns,
                                                                        categories=cats)))
    (tmp_path / "img").mkdir()
    for im in images:
        torchvision.io.write_png(torch.zeros(3, im["height"], im["width"], dtype=torch.uint8),
                                 str(tmp_path / "img" / im["file_name"]))
    return dict(data_root=str(tmp_path), ann_file="annotations/inst.json", data_prefix=dict(img="img/"))


def test_round_trip_gives_shapes_images_boxes_and_labels(shapes):
    ds = CocoDataset(data_root=str(shapes), ann_file="annotations/instances_train.json",
                     data_prefix=dict(img="train/"), pipeline=PACK)
    ref = ShapesDataset(num_samples=12, image_size=32, num_classes=3, max_shapes=3, seed=4, split="train")
    assert len(ds) == 12 and ds.metainfo == {"classes": ("circle", "square", "triangle")}
    for i in range(12):
        item = ds[i]
        img, boxes, labels = ref.draw(i)
        s = item["data_samples"]
        assert s["img_id"] == i + 1 and s["img_path"].endswith(f"train/{i + 1:06d}.png")
        assert torch.equal(item["inputs"], torch.from_numpy(img))  # PNG is lossless
        assert torch.equal(s["gt_instances"]["bboxes"], torch.from_numpy(boxes))
        assert torch.equal(s["gt_instances"]["labels"], torch.from_numpy(labels))
        assert s["ori_shape"] == s["img_shape"] == (32, 32) and len(s["ignored_instances"]["bboxes"]) == 0


def test_parsing_rules_crowd_and_default_classes(hand_made):
    ds = CocoDataset(**hand_made, pipeline=PACK)
    assert ds.metainfo["classes"] == ("dog", "bird", "cat")  # every category, sorted by id
    assert len(ds) == 4  # no filter_cfg: every image
    s = ds[0]["data_samples"]
    assert s["gt_instances"]["bboxes"].tolist() == [[2, 3, 12, 8]] and s["gt_instances"]["labels"].tolist() == [0]
    assert s["ignored_instances"]["bboxes"].tolist() == [[20, 10, 28, 18]]
    assert s["ignored_instances"]["labels"].tolist() == [2]
    info = ds.get_data_info(0)
    assert (info["img_id"], info["height"], info["width"]) == (1, 30, 40)
    assert info["instances"]["ignore_flags"].tolist() == [False, True]


def test_class_subset_in_the_given_order_and_filter_cfg(hand_made):
    ds = CocoDataset(**hand_made, metainfo=dict(classes=("cat",)), pipeline=PACK)
    assert ds.metainfo["classes"] == ("cat",) and ds.cat_ids == [9] and ds.cat2label == {9: 0}
    assert ds[0]["data_samples"]["gt_instances"]["bboxes"].shape == (0, 4)  # its dog is not a selected class
    assert ds[1]["data_samples"]["gt_instances"]["labels"].tolist() == [0]
    swapped = CocoDataset(**hand_made, metainfo=dict(classes=("cat", "dog")), pipeline=PACK)
    assert swapped[0]["data_samples"]["gt_instances"]["labels"].tolist() == [1]  # dog is label 1 here
    kept = CocoDataset(**hand_made, metainfo=dict(classes=("cat",)), filter_cfg=dict(filter_empty_gt=True))
    assert [kept.get_data_info(i)["img_id"] for i in range(len(kept))] == [2]  # image 3 holds only a crowd cat
    small = CocoDataset(**hand_made, filter_cfg=dict(filter_empty_gt=True, min_size=25))
    assert [small.get_data_info(i)["img_id"] for i in range(len(small))] == [1, 2]  # 4 is 20 px wide
    test = CocoDataset(**hand_made, filter_cfg=dict(filter_empty_gt=True, min_size=25), test_mode=True)
    assert len(test) == 4  # filter_cfg is for training only


def test_indices_take_a_subset_after_the_filter_as_mmengine_does(hand_made):
    """MMEngine's BaseDataset ``indices``: the first N images (the last -N), or these positions, of those the
    filter kept; ``serialize_data``/``lazy_init`` are accepted (they change how MMEngine holds the annotations)."""
    def img_ids(**kw) -> list[int]:
        ds = CocoDataset(**hand_made, serialize_data=False, lazy_init=False, **kw)
        return [ds.get_data_info(i)["img_id"] for i in range(len(ds))]

    assert img_ids(indices=2) == [1, 2] and img_ids(indices=-1) == [4] and img_ids(indices=[3, 0]) == [4, 1]
    assert img_ids(indices=1, filter_cfg=dict(filter_empty_gt=True, min_size=25)) == [1]
    assert img_ids(indices=[-1], filter_cfg=dict(filter_empty_gt=True, min_size=25)) == [2]
    for bad, message in ((dict(indices=[0, 9]), "indices: 9 is outside the 4 images left after filter_cfg"),
                         (dict(indices="2"), "indices='2': give a number of images")):
        with pytest.raises(ConfigError, match=message):
            CocoDataset(**hand_made, **bad)


def test_errors_are_one_line_with_the_fix(hand_made, tmp_path):
    cases = [
        (dict(hand_made, ann_file="annotations/missing.json"), "annotations/missing.json' does not exist"),
        (dict(hand_made, metainfo=dict(classes=("dgo",))), "'dgo' is not a category of .*did you mean 'dog'"),
        (dict(hand_made, data_prefix=dict(img="images/")), "images/1.png' .*does not exist: check data_root and"),
        (dict(hand_made, filter_cfg=dict(filter_empty=True)), "unknown key 'filter_empty': did you mean"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            CocoDataset(**cfg)
        assert "\n" not in str(err.value)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a COCO annotation file"):
        CocoDataset(ann_file=str(tmp_path / "bad.json"))


def test_a_pipeline_reading_the_image_before_loading_it_is_refused(hand_made):
    no_load = [dict(type="LoadAnnotations", with_bbox=True), dict(type="RandomFlip", prob=0.5),
               dict(type="PackDetInputs")]
    message = (r"^pipeline\[1\] \(RandomFlip\) reads the image, but no transform before it loads one: "
               r"start the pipeline with dict\(type='LoadImageFromFile'\)$")
    with pytest.raises(ConfigError, match=message):
        CocoDataset(**hand_made, pipeline=no_load)
    CocoDataset(**hand_made, pipeline=[lambda r: r, *no_load])  # a transform memfit cannot see into may load it


def test_a_config_without_collate_fn_batches_as_mmengine_does_and_default_collate_is_refused(shapes):
    dataset = dict(type="CocoDataset", data_root=str(shapes), ann_file="annotations/instances_train.json",
                   data_prefix=dict(img="train/"), pipeline=PACK)
    batch = next(iter(build_dataloader(dict(batch_size=4, dataset=dataset), seed=0)))  # MMDetection's configs
    assert isinstance(batch["inputs"], list) and len(batch["inputs"]) == 4  # pseudo_collate: nothing stacked
    for given in ("default_collate", dict(type="default_collate")):
        with pytest.raises(ConfigError, match=r"^train_dataloader\.collate_fn=default_collate cannot stack "
                                              r"CocoDataset's samples .*use collate_fn=dict\(type='pseudo_collate'\)"):
            build_dataloader(dict(batch_size=4, dataset=dataset, collate_fn=given), seed=0, key="train_dataloader")


def test_skipped_samples_are_refetched_in_training_only(hand_made):
    drop_first = lambda r: None if r["img_id"] == 1 else r  # noqa: E731
    ds = CocoDataset(**hand_made, pipeline=[drop_first])
    torch.manual_seed(0)
    assert ds[0]["img_id"] in (2, 3, 4)
    with pytest.raises(RuntimeError, match="test pipeline must not drop images"):
        CocoDataset(**hand_made, pipeline=[drop_first], test_mode=True)[0]
    with pytest.raises(RuntimeError, match="skipped 3 images in a row"):
        CocoDataset(**hand_made, pipeline=[lambda r: None], max_refetch=2)[0]


def test_loader_batches_are_seeded_per_sample(shapes):
    pipeline = [*LOAD, dict(type="RandomFlip", prob=0.5),
                dict(type="RandomChoiceResize", scales=[(24, 100), (40, 100)], keep_ratio=True),
                dict(type="RandomCrop", crop_type="absolute_range", crop_size=(16, 30), allow_negative_crop=True),
                dict(type="PackDetInputs")]
    cfg = dict(batch_size=4, collate_fn=dict(type="pseudo_collate"),
               dataset=dict(type="CocoDataset", data_root=str(shapes), ann_file="annotations/instances_train.json",
                            data_prefix=dict(img="train/"), pipeline=pipeline))
    first = [next(iter(build_dataloader(cfg, seed=3))) for _ in range(2)]
    a, b = first
    assert set(a) == {"inputs", "data_samples"} and len(a["inputs"]) == 4
    assert all(torch.equal(x, y) for x, y in zip(a["inputs"], b["inputs"]))
    assert [s["gt_instances"]["bboxes"].tolist() for s in a["data_samples"]] == [
        s["gt_instances"]["bboxes"].tolist() for s in b["data_samples"]]


def test_dino_pipelines_run_as_written(shapes):
    """MMDetection's DINO train/test pipelines (configs/dino/dino-4scale_r50_8xb2-12e_coco.py), verbatim."""
    scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333), (640, 1333), (672, 1333),
              (704, 1333), (736, 1333), (768, 1333), (800, 1333)]
    train = [
        dict(type="LoadImageFromFile", backend_args=None),
        dict(type="LoadAnnotations", with_bbox=True),
        dict(type="RandomFlip", prob=0.5),
        dict(type="RandomChoice", transforms=[
            [dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)],
            [dict(type="RandomChoiceResize", scales=[(400, 4200), (500, 4200), (600, 4200)], keep_ratio=True),
             dict(type="RandomCrop", crop_type="absolute_range", crop_size=(384, 600), allow_negative_crop=True),
             dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)],
        ]),
        dict(type="PackDetInputs"),
    ]
    test = [
        dict(type="LoadImageFromFile", backend_args=None),
        dict(type="Resize", scale=(1333, 800), keep_ratio=True),
        dict(type="LoadAnnotations", with_bbox=True),
        dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape", "scale_factor")),
    ]
    common = dict(data_root=str(shapes), ann_file="annotations/instances_train.json", data_prefix=dict(img="train/"))
    ds = CocoDataset(**common, filter_cfg=dict(filter_empty_gt=False), pipeline=train)
    for i in range(4):
        torch.manual_seed(i)
        item = ds[i]
        s = item["data_samples"]
        h, w = s["img_shape"]
        assert min(h, w) in [short for short, _ in scales] and item["inputs"].shape[-2:] == (h, w)
        boxes = s["gt_instances"]["bboxes"]
        assert ((boxes[:, 2] <= w) & (boxes[:, 3] <= h) & (boxes[:, :2] >= 0).all(1)).all()
    out = CocoDataset(**common, test_mode=True, pipeline=test)[0]
    s = out["data_samples"]
    assert out["inputs"].shape == (3, 800, 800) and s["scale_factor"] == (25.0, 25.0) and "flip" not in s
    ref = ShapesDataset(num_samples=12, image_size=32, num_classes=3, max_shapes=3, seed=4).draw(0)[1]
    assert torch.equal(s["gt_instances"]["bboxes"], torch.from_numpy(ref))  # loaded after Resize: original pixels
