"""MMDetection's data transforms, by name and argument, on torchvision.transforms.v2 and tv_tensors.

A detection pipeline runs on one sample dict (MMDetection's ``results``): ``img`` is a
``tv_tensors.Image`` (uint8, RGB, CHW), ``gt_bboxes`` a ``tv_tensors.BoundingBoxes`` (XYXY, its
``canvas_size`` the image's), ``gt_bboxes_labels`` int64 and ``gt_ignore_flags`` bool (COCO crowd
boxes), plus the meta keys ``img_shape``, ``ori_shape``, ``scale_factor``, ``flip``, ``flip_direction``.
Image and boxes go through the same ``torchvision.transforms.v2.functional`` call, so they stay
consistent; boxes are clipped where MMDetection clips them. A transform returning ``None`` (a crop
without boxes) makes the dataset load another sample, as MMEngine's BaseDataset does.

Names resolve in ``DET_TRANSFORMS`` first (``Resize``, ``RandomCrop``, ``RandomChoice`` mean
MMDetection's here), then in ``TRANSFORMS``: a torchvision v2 transform such as
``dict(type='ColorJitter', brightness=0.2)`` transforms the ``Image`` and ``BoundingBoxes`` inside
the dict. Random draws use torch's global generator, which :class:`~memfit.data.seeded.SeededDataset`
seeds per sample, so augmentation is reproducible and resumable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torchvision.io
from torchvision import tv_tensors
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as F

from memfit.data import sizes as S
from memfit.errors import ConfigError, did_you_mean
from memfit.registry import DET_TRANSFORMS, TRANSFORMS

Results = dict[str, Any]
DEFAULT_META_KEYS = ("img_id", "img_path", "ori_shape", "img_shape", "scale_factor", "flip", "flip_direction")
_INTERPOLATION = {"nearest": InterpolationMode.NEAREST, "bilinear": InterpolationMode.BILINEAR,
                  "bicubic": InterpolationMode.BICUBIC, "area": InterpolationMode.BILINEAR}
_BOX_KEYS = ("gt_bboxes", "gt_bboxes_labels", "gt_ignore_flags")


def build_det_pipeline(cfg_list: Sequence[dict | Callable] | None, where: str = "pipeline") -> DetCompose:
    """Compose detection transform configs (or callables); names resolve in DET_TRANSFORMS, then TRANSFORMS."""
    if cfg_list is None:
        cfg_list = []
    if isinstance(cfg_list, dict) or callable(cfg_list):
        cfg_list = [cfg_list]
    if not isinstance(cfg_list, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of dict(type=...), got {type(cfg_list).__name__}")
    return DetCompose([build_det_transform(c, f"{where}[{i}]") for i, c in enumerate(cfg_list)])


def build_det_transform(cfg: dict | Callable, where: str = "pipeline") -> Callable:
    """One transform: MMDetection's name if DET_TRANSFORMS has it, else a TRANSFORMS (torchvision) one."""
    if callable(cfg) and not isinstance(cfg, dict):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected dict(type=...) or a callable, got {type(cfg).__name__}")
    kind = cfg.get("type")
    if isinstance(kind, str) and kind in DET_TRANSFORMS:
        return DET_TRANSFORMS.build(cfg, key=where)  # the messages name the transform
    if isinstance(kind, str) and kind not in TRANSFORMS and "." not in kind:
        names = DET_TRANSFORMS.names() + TRANSFORMS.names()
        raise ConfigError(f"{where}: unknown transform type {kind!r}: {did_you_mean(kind, names)}")
    from memfit.data.transforms import build_transform

    return build_transform(cfg, where)


class DetCompose:
    """Apply transforms in order; ``None`` from one (a sample to skip) ends the chain with ``None``."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, results: Results) -> Results | None:
        for t in self.transforms:
            results = t(results)
            if results is None:
                return None
        return results

    def check_image_loaded(self, where: str = "pipeline") -> None:
        """Refuse a chain in which a transform that reads the image comes before any that loads it (a KeyError
        at the first batch otherwise). Transforms declare ``image_use`` ('loads', 'reads' or 'none'); the
        check stops at the first that does not (a torchvision or user transform may load it)."""
        for i, t in enumerate(self.transforms):
            use = getattr(t, "image_use", None)
            if use == "reads":
                raise ConfigError(f"{where}[{i}] ({type(t).__name__}) reads the image, but no transform before it "
                                  f"loads one: start the pipeline with dict(type='LoadImageFromFile')")
            if use != "none":
                return

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        return S.chain(self.transforms, sizes)

    def __repr__(self) -> str:
        return f"DetCompose({self.transforms!r})"


def _same_size(self: Any, sizes: np.ndarray) -> np.ndarray:
    """The ``output_sizes`` of a transform that keeps the image's size (:mod:`memfit.data.sizes`)."""
    return sizes


def _hw(results: Results) -> tuple[int, int]:
    return tuple(results["img"].shape[-2:])


def _set_boxes(results: Results, boxes: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Store ``boxes`` (re-wrapped on the image's canvas) and, with ``keep``, the matching labels/flags."""
    if keep is not None:
        boxes = boxes[keep]
        for k in _BOX_KEYS[1:]:
            if k in results:
                results[k] = results[k][keep]
    results["gt_bboxes"] = tv_tensors.BoundingBoxes(boxes.as_subclass(torch.Tensor), format="XYXY",
                                                    canvas_size=_hw(results), clamping_mode=None)


def _clip(boxes: torch.Tensor) -> torch.Tensor:
    return F.clamp_bounding_boxes(boxes, clamping_mode="hard")


@DET_TRANSFORMS.register()
class LoadImageFromFile:
    """Decode ``img_path`` with ``torchvision.io.decode_image`` as RGB uint8 (mmcv decodes BGR: keep
    the data preprocessor's ``bgr_to_rgb=False``). Sets ``img``, ``img_shape``, ``ori_shape`` and the
    defaults ``scale_factor=(1.0, 1.0)``, ``flip=False``, ``flip_direction=None``. ``ignore_empty``
    skips a missing file (the dataset loads another); otherwise a missing file is a ConfigError."""

    image_use = "loads"  # DetCompose.check_image_loaded

    output_sizes = _same_size

    def __init__(self, to_float32: bool = False, color_type: str = "color", imdecode_backend: str = "cv2",
                 ignore_empty: bool = False, backend_args: dict | None = None) -> None:
        if color_type != "color":
            raise ConfigError(f"LoadImageFromFile: color_type={color_type!r} is not supported: use 'color' (RGB)")
        check_local_backend(backend_args, "LoadImageFromFile")
        self.to_float32 = to_float32
        self.ignore_empty = ignore_empty

    def __call__(self, results: Results) -> Results | None:
        path = results["img_path"]
        if not os.path.isfile(path):
            if self.ignore_empty:
                return None
            raise ConfigError(f"{path}: image file not found: check the dataset's data_root and data_prefix.img")
        img = torchvision.io.decode_image(path, mode=torchvision.io.ImageReadMode.RGB)
        results["img"] = tv_tensors.Image(img.float() if self.to_float32 else img)
        results["img_shape"] = results["ori_shape"] = _hw(results)
        results.setdefault("scale_factor", (1.0, 1.0))
        results.setdefault("flip", False)
        results.setdefault("flip_direction", None)
        return results


def check_local_backend(backend_args: dict | None, where: str, name: str = "backend_args") -> None:
    """MMEngine's ``backend_args`` (or ``file_client_args``, given as ``name``): local files only, as memfit reads
    them."""
    if backend_args is not None and backend_args.get("backend", "local") != "local":
        raise ConfigError(f"{where}: {name}={backend_args!r}: memfit reads local files only: set {name}=None")


@DET_TRANSFORMS.register()
class LoadAnnotations:
    """The dataset's ``instances`` as ``gt_bboxes`` (XYXY BoundingBoxes), ``gt_bboxes_labels`` and
    ``gt_ignore_flags``, in the coordinates of the original image (as MMDetection, even when it
    follows a Resize in a test pipeline). Masks and segmentation maps are not supported."""

    image_use = "none"

    output_sizes = _same_size

    def __init__(self, with_bbox: bool = True, with_label: bool = True, with_mask: bool = False,
                 with_seg: bool = False, poly2mask: bool = True, box_type: str = "hbox",
                 backend_args: dict | None = None) -> None:
        if with_mask or with_seg or box_type != "hbox":
            raise ConfigError("LoadAnnotations: memfit loads boxes only: set with_mask=False, with_seg=False, "
                              "box_type='hbox'")
        self.with_bbox, self.with_label = with_bbox, with_label

    def __call__(self, results: Results) -> Results:
        inst = results.get("instances") or {}
        boxes = torch.as_tensor(inst.get("bboxes", torch.zeros(0, 4)), dtype=torch.float32).reshape(-1, 4)
        if self.with_bbox:
            canvas = _hw(results) if "img" in results else (results["height"], results["width"])
            results["gt_bboxes"] = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=canvas,
                                                            clamping_mode=None)
            flags = inst.get("ignore_flags", torch.zeros(len(boxes), dtype=torch.bool))
            results["gt_ignore_flags"] = torch.as_tensor(flags, dtype=torch.bool)
        if self.with_label:
            labels = inst.get("labels", torch.zeros(len(boxes), dtype=torch.int64))
            results["gt_bboxes_labels"] = torch.as_tensor(labels, dtype=torch.int64)
        return results


@DET_TRANSFORMS.register()
class RandomFlip:
    """MMDetection's RandomFlip: flip with probability ``prob`` in ``direction`` ('horizontal',
    'vertical', 'diagonal'; a list splits ``prob`` evenly, or pairs with a list of ``prob``).
    Sets ``flip`` and ``flip_direction``."""

    image_use = "reads"

    output_sizes = _same_size

    def __init__(self, prob: float | Sequence[float] | None = None,
                 direction: str | Sequence[str] = "horizontal") -> None:
        directions = [direction] if isinstance(direction, str) else list(direction)
        bad = [d for d in directions if d not in ("horizontal", "vertical", "diagonal")]
        if bad:
            raise ConfigError(f"RandomFlip: direction {bad[0]!r}: {did_you_mean(bad[0], ['horizontal', 'vertical'])}")
        if prob is None:
            raise ConfigError("RandomFlip: set prob (e.g. prob=0.5)")
        probs = [float(p) for p in prob] if isinstance(prob, (list, tuple)) else [float(prob) / len(directions)] * len(
            directions)
        if len(probs) != len(directions) or not 0 <= sum(probs) <= 1:
            raise ConfigError(f"RandomFlip: prob={prob!r} must be in [0, 1] (one per direction when a list)")
        self.directions, self.probs = directions, probs

    def __call__(self, results: Results) -> Results:
        u, cum, chosen = float(torch.rand(())), 0.0, None
        for d, p in zip(self.directions, self.probs):
            cum += p
            if u < cum:
                chosen = d
                break
        results["flip"], results["flip_direction"] = chosen is not None, chosen
        if chosen in ("horizontal", "diagonal"):
            results["img"] = F.horizontal_flip(results["img"])
            if "gt_bboxes" in results:
                results["gt_bboxes"] = F.horizontal_flip(results["gt_bboxes"])
        if chosen in ("vertical", "diagonal"):
            results["img"] = F.vertical_flip(results["img"])
            if "gt_bboxes" in results:
                results["gt_bboxes"] = F.vertical_flip(results["gt_bboxes"])
        return results

    def __repr__(self) -> str:
        return f"RandomFlip(prob={self.probs}, direction={self.directions})"


@DET_TRANSFORMS.register()
class RandomCrop:
    """MMDetection's RandomCrop. ``crop_size`` is (h, w) in pixels (``'absolute'``), a pixel range
    (``'absolute_range'``: h and w each uniform in [min(side, lo), min(side, hi)]) or a fraction
    (``'relative'``, ``'relative_range'``). Boxes are shifted and clipped (``bbox_clip_border``); boxes
    left empty or outside are dropped with their labels. Without boxes left the sample is skipped
    (``None``) unless ``allow_negative_crop``."""

    image_use = "reads"

    def __init__(self, crop_size: Sequence[int | float], crop_type: str = "absolute",
                 allow_negative_crop: bool = False, recompute_bbox: bool = False,
                 bbox_clip_border: bool = True) -> None:
        types = ("relative_range", "relative", "absolute", "absolute_range")
        if crop_type not in types:
            raise ConfigError(f"RandomCrop: crop_type={crop_type!r}: {did_you_mean(crop_type, types)}")
        lo, hi = crop_size
        if crop_type.startswith("absolute") and not (lo > 0 and hi > 0 and (crop_type == "absolute" or lo <= hi)):
            raise ConfigError(f"RandomCrop: crop_size={tuple(crop_size)} must be positive pixels (lo <= hi: range)")
        if crop_type.startswith("relative") and not (0 < lo <= 1 and 0 < hi <= 1):
            raise ConfigError(f"RandomCrop: crop_size={tuple(crop_size)} must be fractions in (0, 1]")
        if recompute_bbox:
            raise ConfigError("RandomCrop: recompute_bbox needs masks, which memfit does not load: remove it")
        self.crop_size, self.crop_type = tuple(crop_size), crop_type
        self.allow_negative_crop, self.bbox_clip_border = allow_negative_crop, bbox_clip_border

    def crop_hw(self, h: int, w: int) -> tuple[int, int]:
        """Draw the crop's (h, w) for an image of (h, w)."""
        a, b = self.crop_size
        if self.crop_type == "absolute":
            return min(int(a), h), min(int(b), w)
        if self.crop_type == "absolute_range":
            return (int(torch.randint(min(h, a), min(h, b) + 1, ())),
                    int(torch.randint(min(w, a), min(w, b) + 1, ())))
        if self.crop_type == "relative_range":
            a, b = (lo + float(torch.rand(())) * (1 - lo) for lo in (a, b))
        return int(h * a + 0.5), int(w * b + 0.5)

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        """Every crop size :meth:`crop_hw` can draw for each ``(h, w)``."""
        h, w = sizes[:, 0], sizes[:, 1]
        a, b = self.crop_size
        if self.crop_type == "absolute":
            return np.stack([np.minimum(int(a), h), np.minimum(int(b), w)], axis=1)
        if self.crop_type == "absolute_range":
            return S.grid(np.stack([np.minimum(h, a), np.minimum(h, b)], 1),
                          np.stack([np.minimum(w, a), np.minimum(w, b)], 1))
        lo_h, lo_w = (h * a + 0.5).astype(np.int64), (w * b + 0.5).astype(np.int64)
        if self.crop_type == "relative":
            return np.stack([lo_h, lo_w], axis=1)
        return S.grid(np.stack([lo_h, h], 1), np.stack([lo_w, w], 1))  # relative_range: a fraction in [lo, 1)

    def __call__(self, results: Results) -> Results | None:
        h, w = _hw(results)
        ch, cw = self.crop_hw(h, w)
        top, left = int(torch.randint(h - ch + 1, ())), int(torch.randint(w - cw + 1, ()))
        results["img"] = F.crop(results["img"], top, left, ch, cw)
        results["img_shape"] = (ch, cw)
        if "gt_bboxes" in results:
            boxes = F.crop(results["gt_bboxes"], top, left, ch, cw)
            if self.bbox_clip_border:
                boxes = _clip(boxes)
            x1, y1, x2, y2 = boxes.unbind(-1)
            keep = (x1 < cw) & (y1 < ch) & (x2 > 0) & (y2 > 0) & (x2 > x1) & (y2 > y1)
            if not keep.any() and not self.allow_negative_crop:
                return None
            _set_boxes(results, boxes, keep)
        return results

    def __repr__(self) -> str:
        return f"RandomCrop(crop_size={self.crop_size}, crop_type={self.crop_type!r})"


@DET_TRANSFORMS.register()
class RandomChoice:
    """MMCV's RandomChoice: run one of ``transforms`` (each a transform list, e.g. DINO's two
    augmentation branches), drawn with probabilities ``prob`` (default uniform)."""

    def __init__(self, transforms: Sequence[Sequence[dict] | dict], prob: Sequence[float] | None = None) -> None:
        if not transforms:
            raise ConfigError("RandomChoice: transforms is empty: give a list of transform lists")
        self.transforms = [build_det_pipeline(t, f"RandomChoice.transforms[{i}]") for i, t in enumerate(transforms)]
        if prob is not None and (len(prob) != len(transforms) or abs(sum(prob) - 1) > 1e-6):
            raise ConfigError(f"RandomChoice: prob={prob!r} needs one probability per branch, summing to 1")
        self.prob = None if prob is None else torch.tensor(prob, dtype=torch.float64)

    def __call__(self, results: Results) -> Results | None:
        if self.prob is None:
            idx = int(torch.randint(len(self.transforms), ()))
        else:
            idx = int(torch.multinomial(self.prob, 1))
        return self.transforms[idx](results)

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        return np.concatenate([t.output_sizes(sizes) for t in self.transforms])

    def __repr__(self) -> str:
        return f"RandomChoice({self.transforms!r})"


@DET_TRANSFORMS.register()
class FilterAnnotations:
    """MMDetection's FilterAnnotations: drop boxes not wider than ``min_gt_bbox_wh[0]`` and taller than
    ``min_gt_bbox_wh[1]``; with none left, ``keep_empty=True`` skips the sample (MMDetection's naming)."""

    image_use = "none"

    output_sizes = _same_size

    def __init__(self, min_gt_bbox_wh: Sequence[float] = (1.0, 1.0), min_gt_mask_area: int = 1, by_box: bool = True,
                 by_mask: bool = False, keep_empty: bool = True) -> None:
        if by_mask or not by_box:
            raise ConfigError("FilterAnnotations: memfit filters by box only: set by_box=True, by_mask=False")
        self.min_w, self.min_h = min_gt_bbox_wh
        self.keep_empty = keep_empty

    def __call__(self, results: Results) -> Results | None:
        boxes = results.get("gt_bboxes")
        if boxes is None or len(boxes) == 0:
            return results
        keep = ((boxes[:, 2] - boxes[:, 0]) > self.min_w) & ((boxes[:, 3] - boxes[:, 1]) > self.min_h)
        if not keep.any() and self.keep_empty:
            return None
        _set_boxes(results, boxes, keep)
        return results


@DET_TRANSFORMS.register()
class PackDetInputs:
    """The last transform: ``{'inputs': uint8 [3, H, W], 'data_samples': dict}`` where the dict holds
    the ``meta_keys`` present in the results, ``img_shape`` (the image's own), ``gt_instances`` (boxes
    float32 [n, 4] XYXY, labels int64 [n]) and ``ignored_instances`` (the crowd boxes)."""

    image_use = "reads"

    output_sizes = _same_size

    def __init__(self, meta_keys: Sequence[str] = DEFAULT_META_KEYS) -> None:
        self.meta_keys = tuple(meta_keys)

    def __call__(self, results: Results) -> Results:
        img = results["img"].as_subclass(torch.Tensor).contiguous()
        sample = {k: results[k] for k in self.meta_keys if k in results}
        sample["img_shape"] = tuple(img.shape[-2:])
        boxes = results.get("gt_bboxes")
        boxes = torch.zeros(0, 4) if boxes is None else boxes.as_subclass(torch.Tensor).float()
        labels = results.get("gt_bboxes_labels", torch.zeros(len(boxes), dtype=torch.int64))
        ignored = results.get("gt_ignore_flags", torch.zeros(len(boxes), dtype=torch.bool))
        sample["gt_instances"] = dict(bboxes=boxes[~ignored], labels=labels[~ignored])
        sample["ignored_instances"] = dict(bboxes=boxes[ignored], labels=labels[ignored])
        return {"inputs": img, "data_samples": sample}

    def __repr__(self) -> str:
        return f"PackDetInputs(meta_keys={self.meta_keys})"
