"""COCO box mAP and proposal recall, MMDetection's ``CocoMetric``, over pycocotools or faster-coco-eval."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.det_transforms import check_local_backend
from memfit.dist import get_rank
from memfit.errors import ConfigError, did_you_mean, first_line, warn_ignored
from memfit.evaluator.metric import BaseMetric
from memfit.logger import LOGGER_NAME
from memfit.registry import METRICS

BACKENDS = ("pycocotools", "faster_coco_eval")
METRICS_SUPPORTED = ("bbox", "proposal")
_NOT_YET = {
    "segm": "needs mask predictions, which memfit's detectors do not produce yet",
    "proposal_fast": "use metric='proposal' (COCO's AR at proposal_nums)",
}
_AP_ITEMS = ("mAP", "mAP_50", "mAP_75", "mAP_s", "mAP_m", "mAP_l")
_SUMMARY_LINE = " {:<18} {} @[ IoU={:<9} | area={:>6s} | maxDets={:>4d} ] = {:0.3f}"


@METRICS.register()
class CocoMetric(BaseMetric):
    """COCO evaluation: ``dict(type='CocoMetric', ann_file='annotations/instances_val2017.json')``.

    Returns MMDetection's keys under the prefix ``coco``: ``bbox_mAP``, ``bbox_mAP_50``, ``bbox_mAP_75``,
    ``bbox_mAP_s``, ``bbox_mAP_m``, ``bbox_mAP_l`` (rounded to 3 decimals; -1.0 where no ground truth
    falls in the range), ``<class>_precision`` per class with ``classwise=True``, and for
    ``metric='proposal'`` ``AR@100``, ``AR@300``, ``AR@1000``, ``AR_s@1000``, ``AR_m@1000``, ``AR_l@1000``.
    Label ``i`` is the category of ``dataset_meta['classes'][i]`` in the annotation file (all its
    categories sorted by id without ``dataset_meta``). Only the images that were processed are
    evaluated. ``ann_file=None`` builds the ground truth from the batches' ``gt_instances`` (resize
    undone, crowd boxes from ``ignored_instances``) with category ids ``0..K-1``, as MMDetection does.
    """

    default_prefix = "coco"

    def __init__(self, ann_file: str | None = None, metric: str | Sequence[str] = "bbox", classwise: bool = False,
                 format_only: bool = False, outfile_prefix: str | None = None,
                 proposal_nums: Sequence[int] = (100, 300, 1000), iou_thrs: float | Sequence[float] | None = None,
                 metric_items: Sequence[str] | None = None, backend: str = "pycocotools",
                 collect_device: str = "cpu", prefix: str | None = None, backend_args: dict | None = None,
                 file_client_args: dict | None = None, sort_categories: bool = False,
                 use_mp_eval: bool = False) -> None:
        super().__init__(collect_device, prefix)
        for name, args in (("backend_args", backend_args), ("file_client_args", file_client_args)):
            check_local_backend(args, f"CocoMetric.{name}", name)
        if sort_categories:  # MMDetection's, for Objects365 v1's unsorted categories
            warn_ignored("CocoMetric(sort_categories=True)", "labels map to the annotation file's categories by "
                         "name (dataset_meta['classes']), in whatever order the file lists them")
        if use_mp_eval:
            warn_ignored("CocoMetric(use_mp_eval=True)", "COCOeval runs in this process (the same results)")
        self.metrics = [metric] if isinstance(metric, str) else list(metric)
        for m in self.metrics:
            if m in _NOT_YET:
                raise ConfigError(f"metric={m!r} is not supported yet: it {_NOT_YET[m]}")
            if m not in METRICS_SUPPORTED:
                raise ConfigError(f"metric={m!r}: {did_you_mean(m, METRICS_SUPPORTED)}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: {did_you_mean(backend, BACKENDS)}")
        self.backend = backend
        self._coco_cls, self._eval_cls, self._eval_kwargs = _backend(backend)
        if not proposal_nums or any(type(n) is not int or n < 1 for n in proposal_nums):
            raise ConfigError(f"proposal_nums={proposal_nums!r}: use positive ints, e.g. (100, 300, 1000)")
        # COCOeval evaluates at maxDets[-1] and cuts each smaller budget from it: keep them ascending.
        self.proposal_nums = sorted(set(proposal_nums))
        self.iou_thrs = (np.linspace(0.5, 0.95, 10) if iou_thrs is None  # COCOeval's own default values
                         else np.array(iou_thrs, dtype=np.float64, ndmin=1))
        if self.iou_thrs.ndim != 1 or not ((self.iou_thrs > 0) & (self.iou_thrs <= 1)).all():
            raise ConfigError(f"iou_thrs={iou_thrs!r}: use IoU values in (0, 1], e.g. [0.5, 0.75]")
        names = _stat_names(self.proposal_nums)
        for item in metric_items or ():
            if item not in names:
                raise ConfigError(f"metric_items: {item!r} is not a COCO result: {did_you_mean(item, names)}")
        self.metric_items = list(metric_items) if metric_items is not None else None
        if format_only and outfile_prefix is None:
            raise ConfigError("format_only=True needs outfile_prefix (e.g. 'work_dirs/coco_test'): the detections "
                              "are written to <outfile_prefix>.bbox.json")
        self.classwise = classwise
        self.format_only = format_only
        self.outfile_prefix = outfile_prefix
        self.ann_file = ann_file
        self._coco_api = None if ann_file is None else self._load_ann_file(ann_file)

    def _load_ann_file(self, ann_file: str) -> Any:
        path = Path(ann_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"ann_file={str(ann_file)!r}: no such file; give the COCO annotation json of the "
                              "evaluated split (or ann_file=None to use the batches' gt_instances)")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints while it loads
                return self._coco_cls(str(path))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"ann_file={str(ann_file)!r} is not a COCO annotation json ({first_line(exc)})") from exc

    def process(self, data_batch: Any, data_samples: Sequence[Mapping]) -> None:
        """Keep each image's predictions as CPU numpy arrays (and, without ann_file, its ground truth)."""
        for i, sample in enumerate(data_samples):
            pred = sample["pred_instances"]
            result = {"img_id": int(sample["img_id"]),
                      "bboxes": _numpy(pred["bboxes"], np.float32).reshape(-1, 4),
                      "scores": _numpy(pred["scores"], np.float32).reshape(-1),
                      "labels": _numpy(pred["labels"], np.int64).reshape(-1)}
            if self._coco_api is None:
                source = sample if "gt_instances" in sample else _batch_sample(data_batch, i)
                result["gt"] = _original_gt(source, sample["ori_shape"])
            self.results.append(result)

    def result_names(self) -> list[str] | None:
        """The box metrics' names (per-class precisions and proposal recalls depend on the data: None)."""
        if self.format_only or self.classwise or "proposal" in self.metrics:
            return None
        return [f"bbox_{item}" for item in self.metric_items or _AP_ITEMS]

    def compute_metrics(self, results: list) -> dict[str, float]:
        logger = logging.getLogger(LOGGER_NAME)
        by_img = {r["img_id"]: r for r in results}  # an image processed twice counts once
        img_ids = sorted(by_img)
        coco_gt = self._coco_api if self._coco_api is not None else self._gt_from_results(by_img, img_ids)
        cat_ids = self._cat_ids(coco_gt)
        unknown = sorted(set(img_ids) - set(coco_gt.getImgIds()))
        if unknown:
            raise ConfigError(f"ann_file={self.ann_file!r} has no image with id {unknown[0]} ({len(unknown)} "
                              "processed images are missing): give the annotation file of the evaluated dataset")
        dets = _detections_json(by_img, img_ids, cat_ids)
        if self.outfile_prefix is not None and get_rank() == 0:
            path = _write_json(dets, f"{self.outfile_prefix}.bbox.json")
            if self._coco_api is None:
                _write_json(coco_gt.dataset, f"{self.outfile_prefix}.gt.json")
            logger.info(f"CocoMetric: {len(dets)} detections written to {path}")
        if self.format_only:
            return {}
        if not dets:
            logger.warning("CocoMetric: no detections in any image: every AP and AR is 0")
        out: dict[str, float] = {}
        for metric in self.metrics:
            coco_eval = self._run_cocoeval(coco_gt, dets, img_ids, cat_ids, use_cats=metric == "bbox")
            stats = _coco_stats(coco_eval, self.proposal_nums)
            logger.info(f"Evaluating {metric} ({self.backend}, {len(img_ids)} images):\n"
                        + _summary_text(stats, self.iou_thrs, self.proposal_nums))
            if metric == "proposal":
                items = self.metric_items or [n for n in stats if n.startswith("AR")]
                out.update({item: round(stats[item], 3) for item in items})
                continue
            if self.classwise:
                out.update(self._classwise(coco_eval, coco_gt, cat_ids, logger))
            out.update({f"bbox_{item}": round(stats[item], 3) for item in self.metric_items or _AP_ITEMS})
            logger.info("bbox_mAP_copypaste: " + " ".join(f"{stats[k]:.3f}" for k in _AP_ITEMS))
        return out

    def _cat_ids(self, coco_gt: Any) -> list[int]:
        """Category id of each label: ``classes[i]`` looked up by name, else all categories by id."""
        by_name: dict[str, int] = {}
        for cat in sorted(coco_gt.dataset.get("categories", []), key=lambda c: c["id"]):
            by_name.setdefault(cat["name"], int(cat["id"]))
        classes = (self.dataset_meta or {}).get("classes")
        if classes is None:
            return list(by_name.values())
        missing = [c for c in classes if c not in by_name]
        if missing:
            raise ConfigError(f"ann_file={self.ann_file!r} has no category named {missing[0]!r} (from the dataset's "
                              f"metainfo classes): {did_you_mean(missing[0], by_name)}")
        return [by_name[c] for c in classes]

    def _gt_from_results(self, by_img: dict[int, dict], img_ids: list[int]) -> Any:
        """A COCO ground truth built from the processed samples (MMDetection's ``gt_to_coco_json``)."""
        classes = (self.dataset_meta or {}).get("classes")
        if classes is None:
            raise ConfigError("CocoMetric(ann_file=None) names categories after the dataset's metainfo['classes'], "
                              "and this dataset has none: give ann_file")
        images, anns = [], []
        for img_id in img_ids:
            gt = by_img[img_id]["gt"]
            images.append({"id": img_id, "width": gt["width"], "height": gt["height"], "file_name": ""})
            for (x1, y1, x2, y2), label, crowd in zip(gt["bboxes"].tolist(), gt["labels"].tolist(), gt["iscrowd"]):
                w, h = x2 - x1, y2 - y1
                anns.append({"id": len(anns) + 1, "image_id": img_id, "bbox": [x1, y1, w, h], "area": w * h,
                             "iscrowd": int(crowd), "category_id": int(label)})
        dataset = {"images": images, "annotations": anns,
                   "categories": [{"id": i, "name": name} for i, name in enumerate(classes)]}
        return _coco_from_dict(self._coco_cls, dataset)

    def _run_cocoeval(self, coco_gt: Any, dets: list[dict], img_ids: list[int], cat_ids: list[int],
                      use_cats: bool) -> Any:
        # pycocotools prints every step: the summary goes to the memfit logger instead.
        with contextlib.redirect_stdout(io.StringIO()):
            coco_dt = coco_gt.loadRes(dets) if dets else _empty_results(self._coco_cls, coco_gt)
            coco_eval = self._eval_cls(coco_gt, coco_dt, "bbox", **self._eval_kwargs)
            p = coco_eval.params
            p.catIds, p.imgIds, p.useCats = list(cat_ids), list(img_ids), int(use_cats)
            p.maxDets, p.iouThrs = list(self.proposal_nums), self.iou_thrs.copy()
            coco_eval.evaluate()
            coco_eval.accumulate()
        return coco_eval

    def _classwise(self, coco_eval: Any, coco_gt: Any, cat_ids: list[int], logger: logging.Logger) -> dict:
        """AP per class at the largest maxDets (MMDetection's ``<class>_precision`` and its table)."""
        precision, p = coco_eval.eval["precision"], coco_eval.params  # [iou, recall, class, area, maxDets]
        column = {int(c): k for k, c in enumerate(p.catIds)}  # faster-coco-eval sorts catIds
        out, rows = {}, []
        for cat_id in cat_ids:
            name = coco_gt.loadCats(cat_id)[0]["name"]
            k = column[cat_id]
            row = [_mean_valid(precision[:, :, k, 0, -1])]
            row += [_mean_valid(precision[np.where(p.iouThrs == t)[0], :, k, 0, -1]) for t in (0.5, 0.75)]
            row += [_mean_valid(precision[:, :, k, a, -1]) for a in (1, 2, 3)]
            out[f"{name}_precision"] = round(row[0], 3)
            rows.append([name] + [f"{round(v, 3)}" for v in row])
        logger.info("\n" + _table(["category", *_AP_ITEMS], rows))
        return out


def _backend(name: str) -> tuple[type, type, dict]:
    """The COCO and COCOeval classes of a backend, and the COCOeval keyword that keeps it quiet."""
    try:
        if name == "pycocotools":
            from pycocotools.coco import COCO
            from pycocotools.cocoeval import COCOeval
            return COCO, COCOeval, {}
        from faster_coco_eval import COCO, COCOeval_faster
        return COCO, COCOeval_faster, {"print_function": lambda *args, **kwargs: None}
    except ImportError as exc:
        raise ConfigError(f"backend={name!r} is not installed: pip install 'memfit[coco]'") from exc


def _stat_names(max_dets: Sequence[int]) -> list[str]:
    last = max_dets[-1]
    return [*_AP_ITEMS, *(f"AR@{n}" for n in max_dets), f"AR_s@{last}", f"AR_m@{last}", f"AR_l@{last}"]


def _mean_valid(values: np.ndarray) -> float:
    """The mean of the entries > -1 (COCOeval's -1 marks "no ground truth"); -1 when there are none."""
    valid = values[values > -1]
    return float(np.mean(valid)) if valid.size else -1.0


def _coco_stats(coco_eval: Any, max_dets: Sequence[int]) -> dict[str, float]:
    """The COCO summary numbers by MMDetection's names, read from ``coco_eval.eval`` as pycocotools'
    ``summarize()`` reads them (AP at 100 detections, every other number at the largest maxDets).

    Not ``summarize()`` itself: it prints, and faster-coco-eval's takes AP at the largest maxDets, so
    one reading of the accumulated arrays keeps the two backends' numbers equal.
    """
    p, precision, recall = coco_eval.params, coco_eval.eval["precision"], coco_eval.eval["recall"]
    maxdet = {int(n): i for i, n in enumerate(p.maxDets)}
    area = {label: i for i, label in enumerate(p.areaRngLbl)}

    def mean(arr: np.ndarray, iou: float | None = None, rng: str = "all", dets: int = max_dets[-1]) -> float:
        if iou is not None:
            arr = arr[np.where(p.iouThrs == iou)[0]]
        return _mean_valid(arr[..., area[rng], maxdet[dets]])

    ap_dets = 100 if 100 in maxdet else max_dets[-1]
    values = [mean(precision, dets=ap_dets), mean(precision, 0.5), mean(precision, 0.75),
              *(mean(precision, rng=r) for r in ("small", "medium", "large")),
              *(mean(recall, dets=n) for n in max_dets), *(mean(recall, rng=r) for r in ("small", "medium", "large"))]
    return dict(zip(_stat_names(max_dets), values))


def _summary_text(stats: dict[str, float], iou_thrs: np.ndarray, max_dets: Sequence[int]) -> str:
    """pycocotools' summary lines for ``stats``."""
    all_ious, last = f"{iou_thrs[0]:0.2f}:{iou_thrs[-1]:0.2f}", max_dets[-1]
    ap, ar, areas = ("Average Precision", "(AP)"), ("Average Recall", "(AR)"), ("small", "medium", "large")
    rows = [(*ap, all_ious, "all", 100 if 100 in max_dets else last), (*ap, "0.50", "all", last),
            (*ap, "0.75", "all", last), *((*ap, all_ious, r, last) for r in areas),
            *((*ar, all_ious, "all", n) for n in max_dets), *((*ar, all_ious, r, last) for r in areas)]
    return "\n".join(_SUMMARY_LINE.format(*row, v) for row, v in zip(rows, stats.values()))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = lambda r: "| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths)) + " |"
    return "\n".join([line, fmt(header), line, *map(fmt, rows), line])


def _numpy(value: Any, dtype: type) -> np.ndarray:
    tensor = torch.as_tensor(value).detach().cpu()
    if tensor.is_floating_point():  # fp16/bf16 predictions under autocast: numpy has no bf16
        tensor = tensor.float()
    return tensor.numpy().astype(dtype, copy=False)


def _batch_sample(data_batch: Any, i: int) -> Mapping:
    samples = data_batch.get("data_samples") if isinstance(data_batch, Mapping) else None
    return samples[i] if isinstance(samples, Sequence) and i < len(samples) else {}


def _original_gt(sample: Mapping, ori_shape: Sequence[int]) -> dict:
    """The sample's boxes in original-image pixels: MMDetection converts the dataset's raw annotations;
    memfit's data samples carry the resized boxes, so the resize (``scale_factor``) is undone."""
    if sample.get("flip"):
        raise ConfigError("CocoMetric(ann_file=None) takes the ground truth from gt_instances, which the val "
                          "pipeline flipped: give ann_file or drop the flip from the val pipeline")
    sx, sy = sample.get("scale_factor", (1.0, 1.0))
    boxes, labels, crowd = [np.zeros((0, 4), np.float32)], [np.zeros(0, np.int64)], [np.zeros(0, np.uint8)]
    for key, is_crowd in (("gt_instances", 0), ("ignored_instances", 1)):
        inst = sample.get(key)
        if inst:
            b = _numpy(inst["bboxes"], np.float64).reshape(-1, 4) / np.array([sx, sy, sx, sy])
            boxes.append(b.astype(np.float32))
            labels.append(_numpy(inst["labels"], np.int64).reshape(-1))
            crowd.append(np.full(len(b), is_crowd, np.uint8))
    return {"height": int(ori_shape[0]), "width": int(ori_shape[1]), "bboxes": np.concatenate(boxes),
            "labels": np.concatenate(labels), "iscrowd": np.concatenate(crowd)}


def _detections_json(by_img: dict[int, dict], img_ids: list[int], cat_ids: list[int]) -> list[dict]:
    """COCO result entries (``xywh`` boxes, category ids) for every processed image, in image-id order."""
    dets = []
    for img_id in img_ids:
        r = by_img[img_id]
        if len(r["labels"]) and not 0 <= r["labels"].min() <= r["labels"].max() < len(cat_ids):
            raise ConfigError(f"CocoMetric: image {img_id} has predicted label {int(r['labels'].max())} but there "
                              f"are {len(cat_ids)} classes: make the head's num_classes match the dataset's classes")
        xywh = r["bboxes"].astype(np.float64)
        xywh[:, 2:] -= xywh[:, :2]
        for box, score, label in zip(xywh.tolist(), r["scores"].tolist(), r["labels"].tolist()):
            dets.append({"image_id": img_id, "bbox": box, "score": score, "category_id": cat_ids[label]})
    return dets


def _coco_from_dict(coco_cls: type, dataset: dict) -> Any:
    coco = coco_cls()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _empty_results(coco_cls: type, coco_gt: Any) -> Any:
    """Detections of no image (pycocotools' ``loadRes`` fails on an empty list): every AP is 0."""
    return _coco_from_dict(coco_cls, {"images": list(coco_gt.dataset["images"]), "annotations": [],
                                      "categories": list(coco_gt.dataset.get("categories", []))})


def _write_json(obj: Any, path: str) -> Path:
    from memfit.checkpoint import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f)
    return Path(path)
