"""The batch the planner plans for: the largest the train pipeline can make, not the first one it makes.

Activations grow with the pixels of a batch (and a DETR-family detector's queries with its boxes), and a
multi-scale pipeline makes batches of many sizes: a plan measured on the first batch can run out of memory
at the hundredth. So every fake step, ``memfit bench`` and auto-fit run on one worst-case batch:

- **derived**: the image sizes the pipeline can output are worked out from its transforms and the dataset's
  image sizes (:mod:`memfit.data.sizes`; CocoDataset reads them from its annotation file). A batch of ``B``
  images is padded to the largest height and the largest width (two images of different orientation pad
  to a square), rounded up to the data preprocessor's ``pad_size_divisor``; one image is the size of
  largest area. Each image holds the most ground-truth boxes one image of the dataset holds.
- **sampled K batches**: where a transform's output size cannot be derived (a callable, a transform with no
  rule), K batches of the loader are drawn and their largest height, width and box count are taken.
- **given**: ``--input-shape BxCxHxW`` (or ``HxW``), or ``planner=dict(input_shape=...)`` in the config.

The batch itself is the dataset's first item, its image resized to the worst size and its boxes replaced
by that many boxes, copied ``B`` times and put through the loader's collate function.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memfit.data import sizes as S
from memfit.data.batch_sampler import batch_size_of
from memfit.errors import ConfigError, did_you_mean

SAMPLED_BATCHES = 8  # batches drawn where the sizes cannot be derived
PLANNER_KEYS = ("input_shape",)


@dataclass(frozen=True)
class PlannedInput:
    """What a plan was planned for: the image batch as the model gets it (``[B, C, H, W]``, padded), the
    ground-truth boxes in each image (detection; None otherwise) and how the size was found."""

    shape: tuple[int, ...]
    boxes_per_image: int | None
    how: str
    why: str = ""  # why the sizes were sampled rather than derived

    def as_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "boxes_per_image": self.boxes_per_image, "how": self.how}

    def describe(self) -> str:
        boxes = f", {self.boxes_per_image} boxes per image" if self.boxes_per_image is not None else ""
        why = f": {self.why}" if self.why else ""
        return f"input {'x'.join(map(str, self.shape))}{boxes} ({self.how}{why})"


def parse_input_shape(value: Any, key: str = "--input-shape") -> tuple[int, ...]:
    """``'2x3x800x1344'``, ``'800x1344'`` or a sequence of 4 or 2 positive ints."""
    parts = value.lower().split("x") if isinstance(value, str) else value
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) not in (2, 4) or min(shape) < 1:
        raise ConfigError(f"{key}={value!r}: give the image batch as BxCxHxW (e.g. 2x3x800x1344) or HxW")
    return shape


class Inputs:
    """The worst-case batch of ``cfg['train_dataloader']`` at any batch size (see the module docstring).
    The dataset is built once; batches are built on first use and kept."""

    def __init__(self, cfg: dict) -> None:
        from memfit.data import SeededDataset, build_dataloader

        options = cfg.get("planner") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"planner={options!r}: use dict(input_shape='2x3x800x1344')")
        for k in options:
            if k not in PLANNER_KEYS:
                raise ConfigError(f"planner: unknown key {k!r}: {did_you_mean(k, PLANNER_KEYS)}")
        loader_cfg = cfg["train_dataloader"]
        if isinstance(loader_cfg, dict):
            loader_cfg = {**loader_cfg, "num_workers": 0, "persistent_workers": False}
            loader_cfg.pop("prefetch_factor", None)
        self.loader = build_dataloader(loader_cfg, seed=0, key="train_dataloader")
        self.batch_size = batch_size_of(self.loader)
        ds = self.loader.dataset
        self.dataset = ds.dataset if isinstance(ds, SeededDataset) else ds
        # The loader's first key: a seeded sample that leaves the caller's random streams as they were.
        self.item = ds[next(iter(getattr(self.loader.batch_sampler, "sampler", self.loader.sampler)), 0)]
        self.channels = _image(self.item).shape[0]
        self.divisor = _pad_divisor(cfg.get("model"))
        self.max_boxes = _max_boxes(self.dataset, self.item)
        self.why = ""
        self._batches: dict[int, Any] = {}
        given = options.get("input_shape")
        if given is not None:
            self.sizes, self.how = self._given(parse_input_shape(given, "planner.input_shape")), "given"
            return
        try:
            self.sizes, self.how = derive_sizes(self.dataset), "derived"
        except S.CannotDerive as exc:
            self.why = str(exc)
            self.sizes, self.how = self._sample(), f"sampled {SAMPLED_BATCHES} batches"

    def _given(self, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 4:
            b, c, h, w = shape
            if b != self.batch_size:
                raise ConfigError(f"input shape {'x'.join(map(str, shape))}: its batch {b} is not "
                                  f"train_dataloader.batch_size={self.batch_size}: give HxW or the same batch size")
            if c != self.channels:
                raise ConfigError(f"input shape {'x'.join(map(str, shape))}: the dataset's images have "
                                  f"{self.channels} channels, not {c}")
        return np.asarray([shape[-2:]], dtype=np.int64)

    def _sample(self) -> np.ndarray:
        """The image sizes of the loader's first batches (and, where the dataset does not say it, their most
        boxes per image)."""
        seen, boxes = [], []
        for _, batch in zip(range(SAMPLED_BATCHES), self.loader):
            seen += [img.shape[-2:] for img in _batch_images(batch)]
            samples = batch.get("data_samples") if isinstance(batch, dict) else None
            boxes += [len(gt["bboxes"]) for gt in map(_gt, samples or []) if gt is not None]
        if self.max_boxes is not None and not callable(getattr(self.dataset, "max_boxes_per_image", None)):
            self.max_boxes = max([self.max_boxes, *boxes])
        return np.asarray([tuple(s) for s in seen], dtype=np.int64).reshape(-1, 2)

    def image_size(self, batch_size: int) -> tuple[int, int]:
        """The (H, W) every image of a worst-case batch of ``batch_size`` has, before the preprocessor pads."""
        h, w = self.sizes[:, 0], self.sizes[:, 1]
        if batch_size > 1:  # the batch pads to its largest height and its largest width
            return int(h.max()), int(w.max())
        i = int(np.argmax(_ceil(h, self.divisor) * _ceil(w, self.divisor)))
        return int(h[i]), int(w[i])

    @property
    def fixed_size(self) -> bool:
        """Whether every batch the pipeline makes has one size (derived or sampled as one, after the data
        preprocessor's padding), so cuDNN's benchmark tunes its convolutions once. A given shape says nothing
        of the others the pipeline makes: not fixed."""
        return self.how != "given" and len(S.unique_rows(_ceil(self.sizes, self.divisor))) == 1

    def planned(self, batch_size: int | None = None) -> PlannedInput:
        """What a batch of ``batch_size`` (default: the configured one) is planned as."""
        b = batch_size or self.batch_size
        h, w = self.image_size(b)
        shape = (b, self.channels, int(_ceil(h, self.divisor)), int(_ceil(w, self.divisor)))
        return PlannedInput(shape, self.max_boxes, self.how, self.why)

    def batch(self, batch_size: int | None = None) -> Any:
        """The worst-case batch of ``batch_size`` images (default: the configured one), collated."""
        b = batch_size or self.batch_size
        if b not in self._batches:
            item = _worst_item(self.item, self.image_size(b), self.max_boxes)
            self._batches[b] = self.loader.collate_fn([copy.deepcopy(item) for _ in range(b)])
        return self._batches[b]


def derive_sizes(dataset: Any) -> np.ndarray:
    """Every ``(h, w)`` the dataset's pipeline can output, from its images' sizes (its ``image_sizes()``). A
    dataset that does not say its sizes is derived only when the pipeline's output does not depend on them."""
    pipeline = getattr(dataset, "pipeline", None) or getattr(dataset, "transform", None)
    known = getattr(dataset, "image_sizes", None)
    if callable(known):
        sizes = np.asarray(known(), dtype=np.int64).reshape(-1, 2)
        return S.unique(sizes if pipeline is None else S.output_sizes(pipeline, sizes))
    if pipeline is None:
        raise S.CannotDerive(f"{type(dataset).__name__} does not say its image sizes (no image_sizes())")
    probes = [S.output_sizes(pipeline, np.asarray([p], dtype=np.int64)) for p in ((64, 64), (4096, 4096), (64, 4096))]
    if all(np.array_equal(probes[0], p) for p in probes[1:]):
        return probes[0]
    raise S.CannotDerive(f"{type(dataset).__name__} does not say its image sizes and its pipeline's output "
                         "depends on them")


def _ceil(x: Any, d: int) -> Any:
    return -(-x // d) * d


def _pad_divisor(model_cfg: Any) -> int:
    """The data preprocessor's ``pad_size_divisor`` (a config or a built model's), else 1."""
    pre = model_cfg.get("data_preprocessor") if isinstance(model_cfg, dict) else getattr(model_cfg,
                                                                                         "data_preprocessor", None)
    value = pre.get("pad_size_divisor", 1) if isinstance(pre, dict) else getattr(pre, "pad_size_divisor", 1)
    return max(1, int(value or 1))


def _image_key(item: Any) -> Any:
    if isinstance(item, dict):
        for k in ("inputs", "img"):
            if isinstance(item.get(k), torch.Tensor):
                return k
    if isinstance(item, (tuple, list)) and item and isinstance(item[0], torch.Tensor):
        return 0
    if isinstance(item, torch.Tensor):
        return None
    raise ConfigError(f"the planner cannot find the image in a train_dataloader item ({type(item).__name__}): "
                      "items should be dict(inputs=...) or dict(img=...), a tuple (img, ...) or a tensor")


def _image(item: Any) -> torch.Tensor:
    key = _image_key(item)
    return item if key is None else item[key]


def _gt(sample: Any) -> dict | None:
    """A detection data sample's ``gt_instances`` (PackDetInputs' layout), else None."""
    gt = sample.get("gt_instances") if isinstance(sample, dict) else None
    return gt if isinstance(gt, dict) and "bboxes" in gt else None


def _targets(item: Any) -> dict | None:
    """A detection item's ``gt_instances``, else None."""
    return _gt(item.get("data_samples")) if isinstance(item, dict) else None


def _max_boxes(dataset: Any, item: Any) -> int | None:
    gt = _targets(item)
    if gt is None:
        return None
    known = getattr(dataset, "max_boxes_per_image", None)
    return int(known()) if callable(known) else len(gt["bboxes"])


def _batch_images(batch: Any) -> list[torch.Tensor]:
    """The images of a collated batch: a stacked tensor's, or a list's (pseudo_collate)."""
    images = batch.get("inputs", batch.get("img")) if isinstance(batch, dict) else (
        batch[0] if isinstance(batch, (tuple, list)) else batch)
    if isinstance(images, torch.Tensor):
        return list(images) if images.dim() == 4 else [images]
    if isinstance(images, (list, tuple)) and all(isinstance(i, torch.Tensor) for i in images):
        return list(images)
    raise ConfigError(f"the planner cannot find the images in a train_dataloader batch ({type(batch).__name__}): "
                      "give the image batch with --input-shape or planner.input_shape")


def _worst_item(item: Any, size: tuple[int, int], boxes: int | None) -> Any:
    """``item`` with its image resized to ``size`` (its own content, so a real step sees real pixels) and, for a
    detection item, ``boxes`` ground-truth boxes spread over the image."""
    from torchvision.transforms.v2 import functional as F

    key = _image_key(item)
    img = F.resize(_image(item), list(size), antialias=False)
    if key is None:
        return img
    if isinstance(item, (tuple, list)):
        return type(item)([img, *item[1:]])
    item = dict(item)
    item[key] = img
    gt = _targets(item)
    if gt is not None and boxes is not None:
        sample = dict(item["data_samples"])
        sample["img_shape"] = tuple(size)
        labels = gt["labels"] if len(gt["labels"]) else torch.zeros(1, dtype=torch.int64)
        sample["gt_instances"] = {**gt, "bboxes": _spread_boxes(boxes, size),
                                  "labels": labels.repeat(math.ceil(boxes / len(labels)))[:boxes].clone()}
        item["data_samples"] = sample
    return item


def _spread_boxes(n: int, size: tuple[int, int]) -> torch.Tensor:
    """``n`` boxes (xyxy) on a grid over an image of ``size``, each inside its own cell."""
    k = max(1, math.ceil(math.sqrt(n)))
    h, w = size[0] / k, size[1] / k
    i = torch.arange(n, dtype=torch.float32)
    x0, y0 = (i % k) * w, torch.div(i, k, rounding_mode="floor") * h
    return torch.stack([x0 + 0.1 * w, y0 + 0.1 * h, x0 + 0.9 * w, y0 + 0.9 * h], dim=1)
