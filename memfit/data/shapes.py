"""ShapesDataset: a built-in synthetic classification/detection set, drawn on the fly.

Every example and test runs and learns with nothing downloaded. Item ``i`` is a pure function of
``(seed, split, i)``: a noisy background and one shape whose geometry is the class, with random
colour, polarity (light on dark or dark on light), size, position and a small tilt, so a model has
to learn the shape, not the colour or the place. With ``max_shapes > 1`` up to ``max_shapes - 1``
non-overlapping extra shapes of random classes are added, each with its box, for detection.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from memfit.data.transforms import build_transforms, default_image_transform
from memfit.errors import ConfigError
from memfit.registry import DATASETS


# Each shape is a predicate on coordinates (u, v) relative to its centre, already tilted, in
# units of its radius r (so |u|, |v| <= ~1.3). Pairs that a rotation maps onto each other
# (square/diamond, cross/X) are not both classes, so the set stays valid under any tilt.
def _circle(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return u * u + v * v <= 1.0


def _square(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.maximum(abs(u), abs(v)) <= 0.8


def _triangle(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return (v <= 0.7) & (abs(u) <= 0.6 * (v + 1.0))


def _cross(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    au, av = abs(u), abs(v)
    return ((au <= 0.3) & (av <= 1.0)) | ((av <= 0.3) & (au <= 1.0))


def _ring(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    d = u * u + v * v
    return (d <= 1.0) & (d >= 0.36)


def _frame(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    m = np.maximum(abs(u), abs(v))
    return (m <= 0.85) & (m >= 0.5)


def _semicircle(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return (u * u + v * v <= 1.0) & (v <= 0.0)


def _ellipse(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return u * u + 4.0 * v * v <= 1.0


def _star(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.hypot(u, v) <= 0.55 + 0.45 * np.cos(5.0 * np.arctan2(v, u))


def _ell(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    inside = (abs(u) <= 0.9) & (abs(v) <= 0.9)
    return inside & ((u <= -0.3) | (v >= 0.3))


SHAPES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "circle": _circle,
    "square": _square,
    "triangle": _triangle,
    "cross": _cross,
    "ring": _ring,
    "frame": _frame,
    "semicircle": _semicircle,
    "ellipse": _ellipse,
    "star": _star,
    "ell": _ell,
}
_DRAW = list(SHAPES.values())
# The farthest any shape reaches from its centre, in radii (the corner of 'ell': 0.9 * sqrt(2)).
_REACH = 1.3
# Radius range as a fraction of the image size (single-shape images), and the largest tilt.
# Measured (tests/core: ResNet-18, 2 classes, 32 px, 48 steps): radii of 0.15-0.3 or full 360°
# rotation leave it at chance; 0.25-0.38 with a ±15° tilt reaches ~80%. Shapes stay the only cue:
# colour, polarity, size, position and tilt are drawn independently of the class.
_RADIUS = (0.25, 0.38)
_TILT = np.pi / 12


@DATASETS.register()
class ShapesDataset(Dataset):
    """Synthetic shapes: ``{'img', 'label', 'boxes', 'labels'}`` per item, deterministic per index.

    ``img`` is a uint8 CHW tensor passed through ``transform`` (a list of transform configs or a
    callable; default: float32 in [-1, 1]; ``transform=[]`` keeps uint8). ``label`` is the class of
    the main shape; ``boxes`` (float32 ``[n, 4]``, xyxy in pixels, exclusive max) and ``labels``
    (int64 ``[n]``) list every shape, the main one first. Items with ``max_shapes > 1`` hold
    different numbers of boxes: batch them with a collate that keeps lists (e.g. ``pseudo_collate``).
    ``split`` picks an independent stream of images ('train', 'val', any string).
    """

    def __init__(
        self,
        num_samples: int = 1000,
        image_size: int = 64,
        num_classes: int = 4,
        seed: int = 0,
        split: str = "train",
        max_shapes: int = 1,
        transform: Sequence[dict | Callable] | Callable | None = None,
    ) -> None:
        if not 1 <= num_classes <= len(SHAPES):
            raise ConfigError(f"ShapesDataset: num_classes={num_classes} must be in [1, {len(SHAPES)}]")
        if image_size < 8:
            raise ConfigError(f"ShapesDataset: image_size={image_size} is too small for a shape: use >= 8")
        if num_samples < 0 or max_shapes < 1:
            raise ConfigError(
                f"ShapesDataset: need num_samples >= 0 and max_shapes >= 1, got {num_samples}, {max_shapes}"
            )
        self.num_samples = int(num_samples)
        self.image_size = int(image_size)
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.split = str(split)
        self.max_shapes = int(max_shapes)
        self.transform = default_image_transform() if transform is None else build_transforms(transform)
        self.metainfo = {"classes": tuple(list(SHAPES)[: self.num_classes])}
        # Split names are hashed with crc32 (stable across processes, unlike hash()).
        self._split_key = zlib.crc32(self.split.encode())
        self._grid = np.arange(self.image_size, dtype=np.float32) + 0.5  # pixel centres

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"ShapesDataset index {index} out of range for {self.num_samples} samples")
        img, boxes, labels = self.draw(int(index) % self.num_samples)
        img_t = torch.from_numpy(img)
        if self.transform is not None:
            img_t = self.transform(img_t)
        return {
            "img": img_t,
            "label": int(labels[0]),
            "boxes": torch.from_numpy(boxes),
            "labels": torch.from_numpy(labels),
        }

    def image_sizes(self) -> np.ndarray:
        """The ``(height, width)`` of every image before ``transform``: one size (int64 ``[1, 2]``)."""
        return np.asarray([[self.image_size, self.image_size]], dtype=np.int64)

    def draw(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draw item ``index``: (uint8 image [3, S, S], float32 boxes [n, 4], int64 labels [n])."""
        rng = np.random.default_rng([self.seed % (1 << 64), self._split_key, index])
        s = self.image_size
        light_on_dark = rng.random() < 0.5
        dark, light = rng.uniform(0, 100, 3), rng.uniform(155, 255, 3)
        background = dark if light_on_dark else light
        canvas = np.broadcast_to(background[:, None, None], (3, s, s)).astype(np.float32)

        boxes: list[list[float]] = []
        labels: list[int] = []
        n_shapes = 1 if self.max_shapes == 1 else int(rng.integers(1, self.max_shapes + 1))
        # Several shapes must fit side by side: shrink them (a 64 px canvas takes 4-5 at this scale).
        size_scale = 1.0 if self.max_shapes == 1 else 0.5
        for k in range(n_shapes):
            label = int(rng.integers(self.num_classes))
            radius = rng.uniform(*_RADIUS) * s * size_scale
            # The first shape always fits; each extra one gets 10 tries to avoid the others, so
            # no box is occluded (and the main shape is always fully visible).
            for _ in range(1 if k == 0 else 10):
                cx, cy = rng.uniform(_REACH * radius, s - _REACH * radius, 2)
                if not any(_overlap((cx, cy, radius), b) for b in boxes):
                    break
            else:
                continue
            angle = rng.uniform(-_TILT, _TILT)
            mask = self._mask(label, cx, cy, radius, angle)
            rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
            if rows.size == 0:  # a thin shape missed every pixel centre (tiny canvases only)
                if k > 0:
                    continue
                # the main shape must exist: grow it about its centre until it covers a pixel
                while rows.size == 0:
                    radius *= 1.25
                    mask = self._mask(label, cx, cy, radius, angle)
                    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
            colour = rng.uniform(155, 255, 3) if light_on_dark else rng.uniform(0, 100, 3)
            canvas[:, mask] = colour[:, None].astype(np.float32)
            boxes.append([cols[0], rows[0], cols[-1] + 1, rows[-1] + 1])
            labels.append(label)

        canvas += rng.normal(0.0, 12.0, canvas.shape).astype(np.float32)
        img = np.clip(canvas, 0, 255).astype(np.uint8)
        return img, np.asarray(boxes, dtype=np.float32).reshape(-1, 4), np.asarray(labels, dtype=np.int64)

    def _mask(self, label: int, cx: float, cy: float, radius: float, angle: float) -> np.ndarray:
        """Boolean [S, S] mask of shape ``label`` centred at (cx, cy), rotated by ``angle``."""
        cos, sin = np.float32(np.cos(angle) / radius), np.float32(np.sin(angle) / radius)
        dx, dy = self._grid[None, :] - np.float32(cx), self._grid[:, None] - np.float32(cy)
        return _DRAW[label](cos * dx + sin * dy, cos * dy - sin * dx)

    def __repr__(self) -> str:
        return (
            f"ShapesDataset(num_samples={self.num_samples}, image_size={self.image_size}, "
            f"num_classes={self.num_classes}, split={self.split!r}, max_shapes={self.max_shapes})"
        )


def _overlap(candidate: tuple[float, float, float], box: list[float]) -> bool:
    """Whether a shape at (cx, cy) with radius r could touch ``box`` (its reach square intersects)."""
    cx, cy, r = candidate
    r *= _REACH
    return not (cx + r <= box[0] or cx - r >= box[2] or cy + r <= box[1] or cy - r >= box[3])
