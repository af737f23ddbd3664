"""CocoDataset: a COCO-format detection set (MMDetection's CocoDataset config), read with pycocotools.

Annotations are parsed once into flat arrays (boxes, labels, crowd flags, per-image offsets), not a
list of dicts per box, so DataLoader workers share them without copy-on-write growth (the reason
MMEngine serialises its data list).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from memfit.data.det_transforms import build_det_pipeline, check_local_backend
from memfit.errors import ConfigError, did_you_mean
from memfit.registry import DATASETS

_FILTER_KEYS = ("filter_empty_gt", "min_size")


def _subset(items: list, indices: int | Sequence[int] | None) -> list:
    """MMEngine's ``indices`` of a dataset, after its filter: the first N (the last -N), or these positions."""
    if indices is None:
        return items
    if isinstance(indices, int) and not isinstance(indices, bool):
        return items[:indices] if indices >= 0 else items[indices:]
    if not isinstance(indices, Sequence) or isinstance(indices, str) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise ConfigError(f"CocoDataset: indices={indices!r}: give a number of images (the first N) or a list of "
                          "image positions")
    outside = [i for i in indices if not -len(items) <= i < len(items)]
    if outside:
        raise ConfigError(f"CocoDataset: indices: {outside[0]} is outside the {len(items)} images left after "
                          "filter_cfg")
    return [items[i] for i in indices]


def _missing_hint(ann_file: str) -> str:
    """The fix for a missing annotation file: the command that writes the built-in shapes as COCO when the
    path is theirs (``<root>/annotations/instances_<split>.json`` under a folder named like shapes_coco)."""
    root = os.path.dirname(os.path.dirname(ann_file))
    if "shapes_coco" in os.path.basename(os.path.normpath(root)):
        return (f"write the synthetic shapes there with `memfit data shapes-coco --out {root} --image-size 96 "
                "--num 2400` (the detection demo's data), or check data_root and ann_file")
    return "check data_root and ann_file"


@DATASETS.register()
class CocoDataset(Dataset):
    """COCO detection: item ``i`` is image ``i``'s data info through ``pipeline`` (ending in PackDetInputs:
    ``{'inputs': uint8 [3, H, W], 'data_samples': dict}``, docs/data.md).

    The data info given to the pipeline is ``dict(img_id, img_path, height, width, instances=dict(
    bboxes=float32 [n, 4] xyxy, labels=int64 [n], ignore_flags=bool [n]))``. ``data_root`` is joined
    to a relative ``ann_file`` and ``data_prefix['img']``, as MMEngine's BaseDataset does.
    ``metainfo=dict(classes=(...))`` selects categories by name, labelled 0..K-1 in that order
    (default: every category, sorted by id); ``self.metainfo['classes']`` names the labels. Boxes
    with w < 1 or h < 1, zero area or no overlap with the image are skipped; crowd boxes become
    ignored instances. Unless ``test_mode``, ``filter_cfg`` drops images with no (non-crowd,
    selected) box (``filter_empty_gt``) and images whose shorter side is below ``min_size``; a
    sample the pipeline skips (returns None) is replaced by a random other one, at most
    ``max_refetch`` times.
    """

    # MMEngine's Runner batches with pseudo_collate when a config names no collate_fn, and MMDetection's
    # configs name none: its images differ in size and each carries its own boxes, which default_collate
    # cannot stack (memfit.data.loader reads this when a config leaves collate_fn out).
    default_collate_fn = "pseudo_collate"

    def __init__(
        self,
        ann_file: str = "",
        data_root: str = "",
        data_prefix: dict | None = None,
        filter_cfg: dict | None = None,
        metainfo: dict | None = None,
        pipeline: Sequence[dict | Callable] = (),
        test_mode: bool = False,
        backend_args: dict | None = None,
        max_refetch: int = 1000,
        indices: int | Sequence[int] | None = None,
        serialize_data: bool = True,
        lazy_init: bool = False,
        file_client_args: dict | None = None,
    ) -> None:
        # serialize_data and lazy_init change how MMEngine holds and when it reads the annotations, not what
        # an item is: memfit keeps them in a few arrays anyway, read here.
        check_local_backend(backend_args, "CocoDataset")
        check_local_backend(file_client_args, "CocoDataset", "file_client_args")
        self.ann_file = _join(data_root, ann_file)
        prefix = dict(data_prefix or {})
        self.img_prefix = _join(data_root, prefix.get("img", prefix.get("img_path", "")))
        self.test_mode = bool(test_mode)
        self.max_refetch = int(max_refetch)
        filter_cfg = dict(filter_cfg or {})
        for k in filter_cfg:
            if k not in _FILTER_KEYS:
                raise ConfigError(f"CocoDataset: filter_cfg: unknown key {k!r}: {did_you_mean(k, _FILTER_KEYS)}")
        if not ann_file or not os.path.isfile(self.ann_file):
            raise ConfigError(f"CocoDataset: ann_file {self.ann_file or '(empty)'!r} does not exist: "
                              f"{_missing_hint(self.ann_file)}")
        self._load(metainfo or {}, filter_cfg, indices)
        self.pipeline = build_det_pipeline(list(pipeline), "pipeline")
        self.pipeline.check_image_loaded("pipeline")
        if len(self) and not os.path.isfile(self._path(0)):
            raise ConfigError(f"CocoDataset: image {self._path(0)!r} (of {self.ann_file}) does not exist: "
                              f"check data_root and data_prefix.img")

    def _load(self, metainfo: dict, filter_cfg: dict, indices: int | Sequence[int] | None) -> None:
        try:
            from pycocotools.coco import COCO
        except ImportError as exc:
            raise ConfigError("CocoDataset needs pycocotools: pip install 'memfit[coco]'") from exc
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
                coco = COCO(self.ann_file)
        except (ValueError, KeyError, TypeError, AssertionError) as exc:  # pycocotools asserts the format
            raise ConfigError(f"CocoDataset: ann_file {self.ann_file!r} is not a COCO annotation file "
                              f"({type(exc).__name__}: {exc})") from exc
        cats = sorted(coco.loadCats(coco.getCatIds()), key=lambda c: c["id"])
        by_name = {c["name"]: c["id"] for c in reversed(cats)}  # a repeated name: its lowest id
        classes = metainfo.get("classes")
        if classes is None:
            classes = [c["name"] for c in cats]
        elif isinstance(classes, str):
            classes = [classes]
        for name in classes:
            if name not in by_name:
                raise ConfigError(f"CocoDataset: metainfo.classes: {name!r} is not a category of {self.ann_file}: "
                                  f"{did_you_mean(name, by_name)}")
        self.metainfo = {**metainfo, "classes": tuple(classes)}
        self.cat_ids = [by_name[n] for n in classes]
        self.cat2label = {cat_id: i for i, cat_id in enumerate(self.cat_ids)}

        filter_empty = bool(filter_cfg.get("filter_empty_gt", False)) and not self.test_mode
        min_size = 0 if self.test_mode else filter_cfg.get("min_size", 0)
        kept = []
        for img_id in coco.getImgIds():
            info = coco.imgs[img_id]
            w, h = info["width"], info["height"]
            if min(w, h) < min_size:
                continue
            parsed = _parse(coco.imgToAnns.get(img_id, []), w, h, self.cat2label)
            if filter_empty and not any(c == 0 for c in parsed[2]):
                continue
            kept.append((img_id, info, parsed))
        ids, names, sizes, boxes, labels, crowd, offsets = [], [], [], [], [], [], [0]
        for img_id, info, (img_boxes, img_labels, img_crowd) in _subset(kept, indices):
            w, h = info["width"], info["height"]
            ids.append(img_id)
            names.append(info["file_name"])
            sizes.append((h, w))
            boxes += img_boxes
            labels += img_labels
            crowd += img_crowd
            offsets.append(len(boxes))
        self._img_ids = np.asarray(ids, dtype=np.int64)
        self._file_names = np.asarray(names, dtype=np.str_)  # one buffer, not a Python str per image
        self._sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        self._boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
        self._labels = np.asarray(labels, dtype=np.int64)
        self._crowd = np.asarray(crowd, dtype=bool)
        self._offsets = np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._img_ids)

    def image_hw(self) -> np.ndarray:
        """Each image's ``(height, width)`` by index, from the annotation file (int64 ``[len, 2]``)."""
        return self._sizes.copy()

    def image_sizes(self) -> np.ndarray:
        """The distinct ``(height, width)`` of the images, from the annotation file (int64 ``[n, 2]``)."""
        return np.unique(self._sizes, axis=0)

    def max_boxes_per_image(self) -> int:
        """The most ground-truth (non-crowd) boxes one image holds, from the annotation file."""
        counts = np.add.reduceat(~self._crowd, self._offsets[:-1]) if len(self._crowd) else np.zeros(0, np.int64)
        counts = np.where(np.diff(self._offsets) > 0, counts, 0)  # reduceat gives an empty image the next's count
        return int(counts.max(initial=0))

    def _path(self, idx: int) -> str:
        return os.path.join(self.img_prefix, str(self._file_names[idx]))

    def get_data_info(self, idx: int) -> dict[str, Any]:
        """Image ``idx``'s data info (fresh arrays: the pipeline may keep or change them)."""
        a, b = self._offsets[idx], self._offsets[idx + 1]
        h, w = self._sizes[idx]
        return dict(
            img_id=int(self._img_ids[idx]),
            img_path=self._path(idx),
            height=int(h),
            width=int(w),
            instances=dict(bboxes=self._boxes[a:b].copy(), labels=self._labels[a:b].copy(),
                           ignore_flags=self._crowd[a:b].copy()),
        )

    def __getitem__(self, idx: int) -> Any:
        idx = int(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(f"CocoDataset index {idx} out of range for {len(self)} images")
        for _ in range(self.max_refetch + 1):
            results = self.pipeline(self.get_data_info(idx % len(self)))
            if results is not None:
                return results
            if self.test_mode:
                raise RuntimeError(f"CocoDataset (test_mode): the pipeline skipped image {self._path(idx)}; a test "
                                   f"pipeline must not drop images (remove RandomCrop/FilterAnnotations)")
            idx = int(torch.randint(len(self), ()))  # seeded per sample by SeededDataset
        raise RuntimeError(f"CocoDataset: the pipeline skipped {self.max_refetch + 1} images in a row: check that "
                           f"its crops and filters can keep boxes (e.g. RandomCrop allow_negative_crop=True)")

    def __repr__(self) -> str:
        return f"CocoDataset(ann_file={self.ann_file!r}, images={len(self)}, classes={len(self.metainfo['classes'])})"


def _join(root: str, path: str) -> str:
    """MMEngine's prefix joining: a relative ``path`` goes under ``root``."""
    if not root or os.path.isabs(path):
        return path
    return os.path.join(root, path)


def _parse(anns: list[dict], w: int, h: int, cat2label: dict[int, int]) -> tuple[list, list, list]:
    """MMDetection's CocoDataset.parse_data_info for boxes: xywh -> xyxy, invalid boxes skipped."""
    boxes, labels, crowd = [], [], []
    for ann in anns:
        if ann.get("ignore", False) or ann["category_id"] not in cat2label:
            continue
        x1, y1, bw, bh = ann["bbox"]
        inter_w = max(0, min(x1 + bw, w) - max(x1, 0))
        inter_h = max(0, min(y1 + bh, h) - max(y1, 0))
        if inter_w * inter_h == 0 or ann.get("area", bw * bh) <= 0 or bw < 1 or bh < 1:
            continue
        boxes.append((x1, y1, x1 + bw, y1 + bh))
        labels.append(cat2label[ann["category_id"]])
        crowd.append(int(ann.get("iscrowd", 0)))
    return boxes, labels, crowd
