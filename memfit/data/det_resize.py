"""MMDetection's resizing and padding transforms (Resize, RandomChoiceResize, RandomResize, Pad) with MMCV's
sizes and rounding, and the rule of each for the image sizes it can output (:mod:`memfit.data.sizes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

from memfit.data import sizes as S
from memfit.data.det_transforms import _INTERPOLATION, Results, _clip, _hw, _set_boxes
from memfit.errors import ConfigError, did_you_mean
from memfit.registry import DET_TRANSFORMS


def rescale_size(old_size: tuple[int, int], scale: float | tuple[int, int]) -> tuple[tuple[int, int], float]:
    """MMCV's ``rescale_size``: ``(w, h)`` scaled by ``scale`` (a number), or as large as fits with its
    long edge <= max(scale) and short edge <= min(scale) (a tuple); rounded half up as MMCV does.
    Returns ``((new_w, new_h), factor)``."""
    w, h = old_size
    if isinstance(scale, (int, float)):
        factor = float(scale)
    else:
        factor = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return (int(w * factor + 0.5), int(h * factor + 0.5)), factor


@DET_TRANSFORMS.register()
class Resize:
    """MMDetection's Resize: to ``scale`` (w, h) exactly, or with ``keep_ratio`` as large as fits in it
    (MMCV's rounding); or by ``scale_factor``. Boxes scale by (new_w / w, new_h / h) and are clipped
    (``clip_object_border``). ``scale_factor`` in the results multiplies over successive resizes, so
    it maps the last resize back to the loaded image (MMCV stores only the last resize's factor; the
    two agree for one Resize, as in test pipelines). Images are resized with antialiasing."""

    image_use = "reads"

    def __init__(self, scale: int | Sequence[int] | None = None, scale_factor: float | Sequence[float] | None = None,
                 keep_ratio: bool = False, clip_object_border: bool = True, backend: str = "cv2",
                 interpolation: str = "bilinear") -> None:
        if scale is None and scale_factor is None:
            raise ConfigError("Resize: set scale=(w, h) or scale_factor")
        if interpolation not in _INTERPOLATION:
            raise ConfigError(f"Resize: interpolation={interpolation!r}: {did_you_mean(interpolation, _INTERPOLATION)}")
        self.scale = (scale, scale) if isinstance(scale, int) else (None if scale is None else tuple(scale))
        self.scale_factor = scale_factor
        self.keep_ratio = keep_ratio
        self.clip_object_border = clip_object_border
        self.interpolation = interpolation

    def target_size(self, h: int, w: int) -> tuple[int, int]:
        """The (new_h, new_w) for an image of (h, w)."""
        scale = self.scale
        if scale is None:
            sf = self.scale_factor
            sx, sy = (sf, sf) if isinstance(sf, (int, float)) else sf
            scale = (int(w * sx + 0.5), int(h * sy + 0.5))  # MMCV's _scale_size
        if self.keep_ratio:
            (new_w, new_h), _ = rescale_size((w, h), scale)
        else:
            new_w, new_h = scale
        return new_h, new_w

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        """:meth:`target_size` of each ``(h, w)`` row, vectorised."""
        if self.scale is None:
            sf = self.scale_factor
            sx, sy = (sf, sf) if isinstance(sf, (int, float)) else sf
            scale_w = (sizes[:, 1] * float(sx) + 0.5).astype(np.int64)
            scale_h = (sizes[:, 0] * float(sy) + 0.5).astype(np.int64)
            if not self.keep_ratio:
                return np.stack([scale_h, scale_w], axis=1)
            return S.rescale(sizes, np.maximum(scale_w, scale_h), np.minimum(scale_w, scale_h))
        if self.keep_ratio:
            return S.rescale(sizes, max(self.scale), min(self.scale))
        return np.asarray([[self.scale[1], self.scale[0]]], dtype=np.int64)

    def __call__(self, results: Results) -> Results:
        h, w = _hw(results)
        new_h, new_w = self.target_size(h, w)
        results["img"] = F.resize(results["img"], [new_h, new_w], interpolation=_INTERPOLATION[self.interpolation],
                                  antialias=self.interpolation != "nearest")
        if "gt_bboxes" in results:
            boxes = F.resize(results["gt_bboxes"], [new_h, new_w])
            _set_boxes(results, _clip(boxes) if self.clip_object_border else boxes)
        fx, fy = results.get("scale_factor", (1.0, 1.0))
        results["scale_factor"] = (fx * new_w / w, fy * new_h / h)
        results["img_shape"] = (new_h, new_w)
        results["keep_ratio"] = self.keep_ratio
        return results

    def __repr__(self) -> str:
        return f"Resize(scale={self.scale}, scale_factor={self.scale_factor}, keep_ratio={self.keep_ratio})"


@DET_TRANSFORMS.register()
class RandomChoiceResize:
    """MMCV's RandomChoiceResize: Resize to one of ``scales`` drawn uniformly (``scale_idx`` records it)."""

    image_use = "reads"

    def __init__(self, scales: Sequence[int | Sequence[int]], resize_type: str = "Resize",
                 **resize_kwargs: Any) -> None:
        # MMCV: a list of scales, or one scale; a tuple of (w, h) pairs is read as a list too
        many = isinstance(scales, list) or (
            isinstance(scales, tuple) and all(isinstance(s, (list, tuple)) for s in scales))
        self.scales = list(scales) if many else [scales]
        if not self.scales:
            raise ConfigError("RandomChoiceResize: scales is empty: give a list of (w, h)")
        self.resizes = [DET_TRANSFORMS.build(dict(type=resize_type, scale=s, **resize_kwargs),
                                             key="RandomChoiceResize") for s in self.scales]

    def __call__(self, results: Results) -> Results:
        idx = int(torch.randint(len(self.scales), ()))
        results = self.resizes[idx](results)
        results["scale_idx"] = idx
        return results

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        return np.concatenate([r.output_sizes(sizes) for r in self.resizes])

    def __repr__(self) -> str:
        return f"RandomChoiceResize(scales={self.scales})"


@DET_TRANSFORMS.register()
class RandomResize:
    """MMCV's RandomResize: Resize to a scale drawn per image. ``scale=(w, h)`` with ``ratio_range=(lo, hi)``:
    ``(int(w * r), int(h * r))`` with ``r`` uniform in ``[lo, hi)``; ``scale=[(w0, h0), (w1, h1)]``: each edge an
    integer uniform between the two. ``resize_kwargs`` (``keep_ratio``, ...) go to ``resize_type``."""

    image_use = "reads"

    def __init__(self, scale: Sequence[int] | Sequence[Sequence[int]], ratio_range: Sequence[float] | None = None,
                 resize_type: str = "Resize", **resize_kwargs: Any) -> None:
        pair = _int_pair(scale)
        if pair is not None:
            if ratio_range is None or len(ratio_range) != 2 or not 0 < ratio_range[0] <= ratio_range[1]:
                raise ConfigError(f"RandomResize: scale={scale!r} is one (w, h): set ratio_range=(lo, hi) with "
                                  f"0 < lo <= hi (got {ratio_range!r}), or give scale=[(w0, h0), (w1, h1)]")
            self.ratio_range = (float(ratio_range[0]), float(ratio_range[1]))
        elif not (isinstance(scale, (list, tuple)) and len(scale) == 2 and all(_int_pair(s) for s in scale)):
            raise ConfigError(f"RandomResize: scale={scale!r}: give (w, h) with ratio_range, or two (w, h) bounds")
        else:
            self.ratio_range = None
        self.scale = pair if pair is not None else tuple(_int_pair(s) for s in scale)
        self.resize = DET_TRANSFORMS.build(dict(type=resize_type, scale=0, **resize_kwargs), key="RandomResize")

    def scales(self) -> list[tuple[int, int]]:
        """Every (w, h) scale this transform can draw."""
        if self.ratio_range is None:
            (a0, a1), (b0, b1) = self.scale
            return [(e0, e1) for e0 in range(min(a0, b0), max(a0, b0) + 1)
                    for e1 in range(min(a1, b1), max(a1, b1) + 1)]
        lo, hi = self.ratio_range
        # int(s * r) changes only where s * r crosses an integer: one ratio inside each interval between those
        # points (and both ends) gives every scale the draw can make.
        cuts = sorted({lo, hi} | {k / s for s in self.scale for k in range(int(s * lo), int(s * hi) + 2)
                                  if lo <= k / s <= hi})
        ratios = [lo, hi] + [(a + b) / 2 for a, b in zip(cuts, cuts[1:])]
        return sorted({(int(self.scale[0] * r), int(self.scale[1] * r)) for r in ratios})

    def _draw(self) -> tuple[int, int]:
        if self.ratio_range is None:
            (a0, a1), (b0, b1) = self.scale
            return (int(torch.randint(min(a0, b0), max(a0, b0) + 1, ())),
                    int(torch.randint(min(a1, b1), max(a1, b1) + 1, ())))
        lo, hi = self.ratio_range
        r = float(torch.rand((), dtype=torch.float64)) * (hi - lo) + lo
        return int(self.scale[0] * r), int(self.scale[1] * r)

    def __call__(self, results: Results) -> Results:
        results["scale"] = self.resize.scale = self._draw()
        return self.resize(results)

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        scales = self.scales()
        if len(scales) * len(sizes) > S.MAX_SIZES:
            raise S.CannotDerive(f"RandomResize: {len(scales):,} scales x {len(sizes):,} image sizes")
        keep = self.resize.scale
        try:
            out = []
            for scale in scales:
                self.resize.scale = scale
                out.append(self.resize.output_sizes(sizes))
        finally:
            self.resize.scale = keep
        return S.unique(np.concatenate(out))

    def __repr__(self) -> str:
        return f"RandomResize(scale={self.scale}, ratio_range={self.ratio_range})"


def _int_pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


_PAD_MODES = ("constant", "edge", "reflect", "symmetric")


@DET_TRANSFORMS.register()
class Pad:
    """MMDetection's Pad: pad the image at the bottom/right to ``size`` (w, h), to a multiple of ``size_divisor``,
    or to a square (``pad_to_square``, then to the divisor if given); never crops. Sets ``img_shape`` and
    ``pad_shape`` to the padded size as MMCV does; boxes keep their pixels."""

    image_use = "reads"

    def __init__(self, size: Sequence[int] | None = None, size_divisor: int | None = None, pad_to_square: bool = False,
                 pad_val: float | dict = 0, padding_mode: str = "constant") -> None:
        if pad_to_square and size is not None:
            raise ConfigError("Pad: pad_to_square=True pads to the long edge: remove size (size_divisor may stay)")
        if not pad_to_square and (size is None) == (size_divisor is None):
            raise ConfigError(f"Pad: set exactly one of size=(w, h) and size_divisor (got size={size!r}, "
                              f"size_divisor={size_divisor!r})")
        if size_divisor is not None and int(size_divisor) < 1:
            raise ConfigError(f"Pad: size_divisor={size_divisor} must be >= 1")
        if padding_mode not in _PAD_MODES:
            raise ConfigError(f"Pad: padding_mode={padding_mode!r}: {did_you_mean(padding_mode, _PAD_MODES)}")
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.size_divisor = None if size_divisor is None else int(size_divisor)
        self.pad_to_square = bool(pad_to_square)
        self.pad_val = pad_val.get("img", 0) if isinstance(pad_val, dict) else pad_val
        self.padding_mode = padding_mode

    def output_sizes(self, sizes: np.ndarray) -> np.ndarray:
        h, w = sizes[:, 0], sizes[:, 1]
        if self.pad_to_square:
            h = w = np.maximum(h, w)
        if self.size_divisor is not None:
            d = self.size_divisor
            h, w = -(-h // d) * d, -(-w // d) * d
        elif self.size is not None:
            h, w = np.maximum(h, self.size[1]), np.maximum(w, self.size[0])
        return np.stack([h, w], axis=1)

    def __call__(self, results: Results) -> Results:
        h, w = _hw(results)
        (ph, pw), = self.output_sizes(np.asarray([[h, w]], dtype=np.int64))
        results["img"] = F.pad(results["img"], [0, 0, int(pw) - w, int(ph) - h], fill=self.pad_val,
                               padding_mode=self.padding_mode)
        results["img_shape"] = results["pad_shape"] = (int(ph), int(pw))
        results["pad_fixed_size"], results["pad_size_divisor"] = self.size, self.size_divisor
        if "gt_bboxes" in results:
            _set_boxes(results, results["gt_bboxes"])
        return results

    def __repr__(self) -> str:
        return f"Pad(size={self.size}, size_divisor={self.size_divisor}, pad_to_square={self.pad_to_square})"
