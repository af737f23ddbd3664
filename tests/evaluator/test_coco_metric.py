"""CocoMetric gives pycocotools' own numbers (COCOeval run directly on the same json results), on both
backends, for crowd boxes, empty images, images without detections, class subsets and partial runs."""

import contextlib
import copy
import io
import json
import logging
import random

import numpy as np
import pytest
import torch

pytest.importorskip("pycocotools")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

from memfit.errors import ConfigError  # noqa: E402
from memfit.evaluator import CocoMetric  # noqa: E402
from memfit.evaluator.coco_metric import _coco_stats  # noqa: E402
from memfit.registry import METRICS  # noqa: E402

# Category ids are not contiguous and not listed in id order: label i must still find its id.
CATEGORIES = [{"id": 7, "name": "bird"}, {"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}]
CAT_IDS = [1, 3, 7]  # sorted by id: the label order without dataset_meta
AP_KEYS = ["bbox_mAP", "bbox_mAP_50", "bbox_mAP_75", "bbox_mAP_s", "bbox_mAP_m", "bbox_mAP_l"]
MAX_DETS = [100, 300, 1000]


def _make_case(tmp_path, seed, n_images=8):
    """An annotation file and per-image predictions (the detectors' predict output)."""
    rng = random.Random(seed)
    images, anns, outputs = [], [], []
    for img_id in range(1, n_images + 1):
        h, w = rng.randint(200, 480), rng.randint(200, 640)
        images.append({"id": img_id * 10, "height": h, "width": w, "file_name": f"{img_id}.jpg"})
        boxes = []
        n_gt = 0 if img_id in (2, 5) else rng.randint(1, 6)  # images 2 and 5 have no ground truth
        for k in range(n_gt):
            bw, bh = rng.choice([(8, 12), (20, 30), (50, 60), (120, 150)])
            x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            crowd = int(k == 0 and img_id % 3 == 0)
            cat = rng.choice(CAT_IDS)
            anns.append({"id": len(anns) + 1, "image_id": img_id * 10, "category_id": cat, "bbox": [x, y, bw, bh],
                         "area": bw * bh * rng.uniform(0.6, 1.0), "iscrowd": crowd})
            boxes.append((x, y, bw, bh, CAT_IDS.index(cat)))
        dets = []
        if img_id != 4:  # image 4: no detections at all
            for x, y, bw, bh, label in boxes:
                if rng.random() < 0.85:
                    j = rng.uniform(-0.08, 0.08)
                    lab = label if rng.random() < 0.8 else rng.randrange(3)
                    score = rng.uniform(0, 0.1) if img_id == 7 else rng.random()
                    dets.append((x + j * bw, y - j * bh, x + bw * (1 + j), y + bh * (1 - j), lab, score))
            for _ in range(rng.randint(0, 5)):
                x, y = rng.uniform(0, w - 40), rng.uniform(0, h - 40)
                dets.append((x, y, x + rng.uniform(5, 40), y + rng.uniform(5, 40), rng.randrange(3), rng.random()))
            if img_id == 7:  # 150 false positives of one class above its true boxes: AP at 100 detections
                x, y = w - 40, h - 40  # (mAP) and at 1000 (the other five) differ
                dets += [(x, y, x + 30, y + 30, boxes[0][4], rng.uniform(0.1, 0.15)) for _ in range(150)]
        outputs.append({"img_id": img_id * 10, "ori_shape": (h, w), "pred_instances": {
            "bboxes": torch.tensor([d[:4] for d in dets], dtype=torch.float32).reshape(-1, 4),
            "scores": torch.tensor([d[5] for d in dets], dtype=torch.float32),
            "labels": torch.tensor([d[4] for d in dets], dtype=torch.int64)}})
    path = tmp_path / f"ann{seed}.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": CATEGORIES}))
    return path, outputs


def _ref_json(outputs, cat_ids):
    res = []
    for o in outputs:
        p = o["pred_instances"]
        for (x1, y1, x2, y2), s, lab in zip(p["bboxes"].tolist(), p["scores"].tolist(), p["labels"].tolist()):
            res.append({"image_id": o["img_id"], "bbox": [x1, y1, x2 - x1, y2 - y1], "score": s,
                        "category_id": cat_ids[lab]})
    return res


def _reference(ann, dets, img_ids, cat_ids, use_cats=1):
    """pycocotools' COCOeval on its own, with MMDetection's parameters."""
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(ann))
        ev = COCOeval(gt, gt.loadRes(copy.deepcopy(dets)), "bbox")
        ev.params.imgIds, ev.params.catIds, ev.params.maxDets = sorted(img_ids), cat_ids, MAX_DETS
        ev.params.useCats = use_cats
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def _run(outputs, batch=3, meta=None, data_batches=None, **kwargs):
    metric = CocoMetric(**kwargs)
    metric.dataset_meta = meta
    for i in range(0, len(outputs), batch):
        metric.process(data_batches[i // batch] if data_batches else None, outputs[i:i + batch])
    return metric.evaluate()


def _expected(ev):
    return {f"coco/{k}": round(float(v), 3) for k, v in zip(AP_KEYS, ev.stats[:6])}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_pycocotools(tmp_path, seed, capsys, caplog):
    caplog.set_level(logging.INFO, logger="memfit")
    ann, outputs = _make_case(tmp_path, seed)
    ref = _reference(ann, _ref_json(outputs, CAT_IDS), [o["img_id"] for o in outputs], CAT_IDS)
    assert _run(outputs, ann_file=str(ann)) == _expected(ref)
    assert "DONE" not in capsys.readouterr().out  # pycocotools' prints are swallowed ...
    text = caplog.text  # ... and the summary is logged
    assert "bbox_mAP_copypaste: " + " ".join(f"{v:.3f}" for v in ref.stats[:6]) in text
    assert f"Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets= 100 ] = {ref.stats[0]:0.3f}" in text
    # The unrounded summary is pycocotools' summarize(), all 12 numbers, exactly ...
    assert list(_coco_stats(ref, MAX_DETS).values()) == ref.stats.tolist()
    # ... in a case where the 100-detection cut (mAP's) and the 1000 one (the other five's) differ.
    at_100, at_1000 = ref.eval["precision"][..., 0, 0], ref.eval["precision"][..., 0, -1]
    assert at_100[at_100 > -1].mean() != at_1000[at_1000 > -1].mean()


def test_hand_made(tmp_path):
    """Two images: one box found exactly, one found at IoU 0.64 with a false positive scored above it."""
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "height": 100, "width": 100}, {"id": 2, "height": 100,
                                                                                    "width": 100}],
                               "annotations": [
                                   {"id": 1, "image_id": 1, "category_id": 5, "bbox": [10, 10, 50, 50], "area": 2500,
                                    "iscrowd": 0},
                                   {"id": 2, "image_id": 2, "category_id": 5, "bbox": [0, 0, 50, 40], "area": 2000,
                                    "iscrowd": 0}],
                               "categories": [{"id": 5, "name": "a"}]}))
    pred = lambda img, boxes, scores: {"img_id": img, "ori_shape": (100, 100), "pred_instances": {
        "bboxes": torch.tensor(boxes, dtype=torch.float32), "scores": torch.tensor(scores),
        "labels": torch.zeros(len(boxes), dtype=torch.int64)}}
    # IoU(image 2) = 32*40 / (50*40) = 0.64: a hit at the thresholds 0.50, 0.55 and 0.60 only.
    outputs = [pred(1, [[10, 10, 60, 60]], [0.9]), pred(2, [[18, 0, 50, 40], [70, 70, 90, 90]], [0.5, 0.95])]
    got = _run(outputs, ann_file=str(ann))
    # IoU <= 0.6: ranks FP(0.95), TP(0.9), TP(0.5) -> precision 2/3 at every recall; COCO's interpolation
    # takes the max to the right, so recall up to 1.0 is covered at 2/3: AP = 2/3. At IoU >= 0.65 only image 1's
    # box counts: recall 0.5 at precision 1/2 -> 51 of 101 recall points at 0.5.
    ap_high = 51 * 0.5 / 101
    assert got["coco/bbox_mAP_50"] == round(2 / 3, 3)
    assert got["coco/bbox_mAP_75"] == round(ap_high, 3)
    assert got["coco/bbox_mAP"] == round((3 * (2 / 3) + 7 * ap_high) / 10, 3)
    assert got["coco/bbox_mAP_s"] == -1.0 and got["coco/bbox_mAP_l"] == -1.0  # no ground truth in those ranges


@pytest.mark.parametrize("shuffle_dets", [False, True])
def test_any_order(tmp_path, shuffle_dets):
    ann, outputs = _make_case(tmp_path, 3)
    want = _run(outputs, ann_file=str(ann))
    rng = random.Random(0)
    shuffled = outputs[::-1]
    if shuffle_dets:  # scores are distinct, so COCOeval's sort by score decides; the order within an image does not
        for o in shuffled:
            perm = torch.tensor(rng.sample(range(len(o["pred_instances"]["scores"])),
                                           len(o["pred_instances"]["scores"])), dtype=torch.int64)
            o["pred_instances"] = {k: v[perm] for k, v in o["pred_instances"].items()}
    assert _run(shuffled, batch=2, ann_file=str(ann)) == want


def test_class_subset_and_classwise(tmp_path):
    ann, outputs = _make_case(tmp_path, 4)
    meta = {"classes": ("dog", "bird")}  # label 0 -> 'dog' (id 3), label 1 -> 'bird' (id 7)
    for o in outputs:  # the model knows dog and bird only: its labels 0, 1 were 1, 2 in CAT_IDS order
        keep = o["pred_instances"]["labels"] > 0
        o["pred_instances"] = {k: v[keep] for k, v in o["pred_instances"].items()}
        o["pred_instances"]["labels"] -= 1
    ref = _reference(ann, _ref_json(outputs, [3, 7]), [o["img_id"] for o in outputs], [3, 7])
    got = _run(outputs, meta=meta, ann_file=str(ann), classwise=True)
    precision = ref.eval["precision"]  # [iou, recall, class, area, maxDets], classes in catIds order [3, 7]
    per_class = {}
    for k, name in enumerate(["dog", "bird"]):
        p = precision[:, :, k, 0, -1]
        per_class[f"coco/{name}_precision"] = round(float(np.mean(p[p > -1])), 3)
    assert got == {**per_class, **_expected(ref)}
    assert got["coco/bbox_mAP"] > 0.1  # the labels do name the right categories


@pytest.mark.parametrize("seed", [0, 5])
def test_faster_coco_eval_agrees(tmp_path, seed):
    pytest.importorskip("faster_coco_eval")
    ann, outputs = _make_case(tmp_path, seed)
    img_ids = [o["img_id"] for o in outputs]
    ref = _reference(ann, _ref_json(outputs, CAT_IDS), img_ids, CAT_IDS)
    metric = CocoMetric(ann_file=str(ann), backend="faster_coco_eval")
    ev = metric._run_cocoeval(metric._coco_api, _ref_json(outputs, CAT_IDS), img_ids, CAT_IDS, use_cats=True)
    np.testing.assert_allclose(list(_coco_stats(ev, MAX_DETS).values()), ref.stats, rtol=0, atol=1e-4)
    meta = {"classes": ("cat", "dog", "bird")}
    fast = _run(outputs, meta=meta, ann_file=str(ann), backend="faster_coco_eval", classwise=True)
    slow = _run(outputs, meta=meta, ann_file=str(ann), classwise=True)
    assert fast.keys() == slow.keys()
    assert all(abs(fast[k] - slow[k]) <= 1e-3 for k in slow)  # rounded to 3 decimals: at most one step apart


@pytest.mark.parametrize("backend", ["pycocotools", "faster_coco_eval"])
def test_partial_run_evaluates_processed_images_only(tmp_path, backend):
    pytest.importorskip("faster_coco_eval")
    ann, outputs = _make_case(tmp_path, 6)
    part = outputs[:5]
    ref = _reference(ann, _ref_json(part, CAT_IDS), [o["img_id"] for o in part], CAT_IDS)
    got = _run(part, ann_file=str(ann), backend=backend)
    assert all(abs(got[k] - v) <= 1e-3 for k, v in _expected(ref).items())
    if backend == "pycocotools":
        assert got == _expected(ref)


def test_no_detections_and_proposal_recall(tmp_path):
    ann, outputs = _make_case(tmp_path, 7)
    ref = _reference(ann, _ref_json(outputs, CAT_IDS), [o["img_id"] for o in outputs], CAT_IDS, use_cats=0)
    got = _run(outputs, ann_file=str(ann), metric="proposal")
    names = ["AR@100", "AR@300", "AR@1000", "AR_s@1000", "AR_m@1000", "AR_l@1000"]
    assert got == {f"coco/{n}": round(float(v), 3) for n, v in zip(names, ref.stats[6:12])}
    empty = [{**o, "pred_instances": {k: v[:0] for k, v in o["pred_instances"].items()}} for o in outputs]
    got = _run(empty, ann_file=str(ann), metric=["bbox", "proposal"])
    assert got["coco/bbox_mAP"] == 0.0 and got["coco/bbox_mAP_50"] == 0.0 and got["coco/AR@100"] == 0.0


def test_gt_from_data_samples(tmp_path):
    """ann_file=None: the batches' gt_instances (resized by 2) and ignored_instances (crowd) are the truth."""
    ann, outputs = _make_case(tmp_path, 8)
    data = json.loads(ann.read_text())
    index = {c["id"]: i for i, c in enumerate(sorted(CATEGORIES, key=lambda c: c["id"]))}

    def instances(anns):  # COCO xywh -> xyxy in the resized (x2) image, as after a Resize transform
        boxes = [[2 * x, 2 * y, 2 * (x + w), 2 * (y + h)] for x, y, w, h in (a["bbox"] for a in anns)]
        return {"bboxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                "labels": torch.tensor([index[a["category_id"]] for a in anns], dtype=torch.int64)}

    samples = []
    for o in outputs:
        anns = [a for a in data["annotations"] if a["image_id"] == o["img_id"]]
        samples.append({"img_id": o["img_id"], "scale_factor": (2.0, 2.0), "flip": False,
                        "gt_instances": instances([a for a in anns if not a["iscrowd"]]),
                        "ignored_instances": instances([a for a in anns if a["iscrowd"]])})
    # The reference: MMDetection's converted json (category ids 0..K-1, area = box area, float32 boxes).
    for a in data["annotations"]:
        a["bbox"] = [float(np.float32(v)) for v in a["bbox"][:2]] + [
            float(np.float32(a["bbox"][0] + a["bbox"][2])) - float(np.float32(a["bbox"][0])),
            float(np.float32(a["bbox"][1] + a["bbox"][3])) - float(np.float32(a["bbox"][1]))]
        a["area"], a["category_id"] = a["bbox"][2] * a["bbox"][3], index[a["category_id"]]
    data["categories"] = [{"id": i, "name": n} for i, n in enumerate(["cat", "dog", "bird"])]
    converted = tmp_path / "converted.json"
    converted.write_text(json.dumps(data))
    ref = _reference(converted, _ref_json(outputs, [0, 1, 2]), [o["img_id"] for o in outputs], [0, 1, 2])
    batches = [{"inputs": [], "data_samples": samples[i:i + 3]} for i in range(0, len(samples), 3)]
    assert _run(outputs, meta={"classes": ("cat", "dog", "bird")}, data_batches=batches) == _expected(ref)


def test_format_only_and_outfile(tmp_path):
    ann, outputs = _make_case(tmp_path, 9)
    prefix = tmp_path / "out" / "coco_test"
    assert _run(outputs, ann_file=str(ann), format_only=True, outfile_prefix=str(prefix)) == {}
    written = json.loads((tmp_path / "out" / "coco_test.bbox.json").read_text())
    assert written == _ref_json(sorted(outputs, key=lambda o: o["img_id"]), CAT_IDS)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["coco_test.bbox.json"]  # no temporary left
    assert "coco/bbox_mAP" in _run(outputs, ann_file=str(ann), outfile_prefix=str(tmp_path / "again"))
    assert (tmp_path / "again.bbox.json").is_file()


def test_process_keeps_small_cpu_arrays(tmp_path):
    ann, outputs = _make_case(tmp_path, 10, n_images=1)
    pred = outputs[0]["pred_instances"]
    bf16 = {**outputs[0], "pred_instances": {**pred, "bboxes": pred["bboxes"].bfloat16().requires_grad_(True),
                                             "scores": pred["scores"].bfloat16()}}
    metric = CocoMetric(ann_file=str(ann))
    metric.process(None, [bf16])  # autocast's bf16 outputs, with grad
    assert {k: (type(v), getattr(v, "dtype", None)) for k, v in metric.results[0].items()} == {
        "img_id": (int, None), "bboxes": (np.ndarray, np.float32), "scores": (np.ndarray, np.float32),
        "labels": (np.ndarray, np.int64)}
    np.testing.assert_array_equal(metric.results[0]["bboxes"], pred["bboxes"].bfloat16().float().numpy())
    metric.evaluate()
    metric.process(None, outputs)
    first = metric.evaluate()
    metric.process(None, outputs)
    assert metric.evaluate() == first  # the ground truth is reused unchanged


def test_errors(tmp_path):
    ann, outputs = _make_case(tmp_path, 11, n_images=2)
    build = lambda **kw: METRICS.build(dict(type="CocoMetric", **kw), key="val_evaluator")
    cases = [
        (dict(ann_file="missing/instances_val.json"), "val_evaluator: ann_file='missing/instances_val.json': no such"),
        (dict(ann_file=str(ann), format_only=True), "format_only=True needs outfile_prefix"),
        (dict(ann_file=str(ann), metric="segm"), "metric='segm' is not supported yet"),
        (dict(ann_file=str(ann), metric="bbx"), "did you mean 'bbox'"),
        (dict(ann_file=str(ann), backend="faster"), "did you mean 'faster_coco_eval'"),
        (dict(ann_file=str(ann), metric_items=["mAP_5"]), "did you mean .*'mAP_50'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
            build(**kwargs)
        assert "\n" not in str(info.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not a COCO annotation json"):
        CocoMetric(ann_file=str(bad))
    with pytest.raises(ConfigError, match="no category named 'dgo'.*did you mean 'dog'"):
        _run(outputs, meta={"classes": ("cat", "dgo")}, ann_file=str(ann))
    with pytest.raises(ConfigError, match="has no image with id 999"):
        _run([{**outputs[0], "img_id": 999}], ann_file=str(ann))
    one_box = {"bboxes": torch.tensor([[0.0, 0.0, 5.0, 5.0]]), "scores": torch.tensor([0.5]),
               "labels": torch.tensor([2])}
    with pytest.raises(ConfigError, match="predicted label 2 but there are 2 classes"):
        _run([{**outputs[0], "pred_instances": one_box}], meta={"classes": ("cat", "dog")}, ann_file=str(ann))
    with pytest.raises(ConfigError, match="ann_file=None.*metainfo"):
        _run(outputs, data_batches=[{"data_samples": [{}, {}]}])


def test_the_box_metrics_names_are_known_before_evaluating():
    """What a checkpoint's save_best is checked against before training: MMDetection's keys under the prefix; none
    where they depend on the data (per-class precisions, proposal recalls) or nothing is computed."""
    assert CocoMetric(ann_file=None).metric_names() == [f"coco/bbox_{k}" for k in
                                                        ("mAP", "mAP_50", "mAP_75", "mAP_s", "mAP_m", "mAP_l")]
    assert CocoMetric(ann_file=None, metric_items=["mAP_50"], prefix="val").metric_names() == ["val/bbox_mAP_50"]
    assert CocoMetric(ann_file=None, classwise=True).metric_names() is None
    assert CocoMetric(ann_file=None, metric="proposal").metric_names() is None
