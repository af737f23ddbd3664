"""Every image size a pipeline can output, derived from its transforms without running them.

The planner plans for the largest batch the data can make (:mod:`memfit.planner.inputs`), and with
multi-scale resizes and random crops the first batch is rarely that. Sizes are ``(h, w)`` rows of an
int64 array; each transform maps the array of sizes that can reach it to the array of sizes it can
produce from them, enumerating its random choices (every scale of a RandomChoiceResize, every crop
size of a range, every branch of a RandomChoice) with the transform's own rounding. A transform
declares its rule as an ``output_sizes(sizes)`` method (memfit's detection transforms do); common
torchvision v2 transforms have theirs here. Anything else raises :class:`CannotDerive`, and the
planner samples batches instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

# More candidate sizes than this after a transform: derivation stops (the planner samples instead).
MAX_SIZES = 2_000_000

# torchvision v2 transforms that keep an image's height and width.
_SAME_SIZE = frozenset({
    "ToImage", "ToDtype", "ConvertImageDtype", "ToPureTensor", "Normalize", "ColorJitter", "RandomHorizontalFlip",
    "RandomVerticalFlip", "GaussianBlur", "GaussianNoise", "RandomGrayscale", "Grayscale", "RandomErasing",
    "RandomInvert", "RandomPosterize", "RandomSolarize", "RandomAdjustSharpness", "RandomAutocontrast",
    "RandomEqualize", "RandomPhotometricDistort", "RandomChannelPermutation", "AutoAugment", "RandAugment",
    "TrivialAugmentWide", "AugMix", "Identity", "Lambda", "SanitizeBoundingBoxes", "ClampBoundingBoxes",
})


class CannotDerive(Exception):
    """A transform whose output size is not known from its input size (the message names it)."""


def unique(sizes: np.ndarray) -> np.ndarray:
    """Distinct rows, refused beyond :data:`MAX_SIZES`."""
    sizes = unique_rows(np.asarray(sizes, dtype=np.int64).reshape(-1, 2))
    if len(sizes) > MAX_SIZES:
        raise CannotDerive(f"more than {MAX_SIZES:,} possible image sizes")
    return sizes


def grid(h_ranges: np.ndarray, w_ranges: np.ndarray) -> np.ndarray:
    """Every ``(h, w)`` with ``h`` in ``[lo, hi]`` of a row of ``h_ranges`` and ``w`` likewise, row by row
    (each row of the two ``[n, 2]`` arrays is one input's ranges); the distinct range pairs are expanded once."""
    pairs = unique_rows(np.concatenate([h_ranges, w_ranges], axis=1))
    if int(((pairs[:, 1] - pairs[:, 0] + 1) * (pairs[:, 3] - pairs[:, 2] + 1)).sum()) > MAX_SIZES:
        raise CannotDerive(f"more than {MAX_SIZES:,} possible crop sizes")
    out = [np.stack(np.meshgrid(np.arange(a, b + 1), np.arange(c, d + 1), indexing="ij"), -1).reshape(-1, 2)
           for a, b, c, d in pairs]
    return unique(np.concatenate(out))


def unique_rows(a: np.ndarray) -> np.ndarray:
    """Distinct rows of an int64 ``[n, 2]`` (or ``[n, 4]``) array of non-negative values below 2**31, sorted."""
    a = np.asarray(a, dtype=np.int64)
    if a.shape[1] != 2:
        return np.unique(a, axis=0)
    keys = np.unique((a[:, 0] << 32) | a[:, 1])  # one sort of int64 keys, 10x faster than unique(axis=0)
    return np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1)


def rescale(sizes: np.ndarray, long: Any, short: Any) -> np.ndarray:
    """MMCV's keep-ratio ``rescale_size`` of each ``(h, w)`` to a scale of edges ``long`` >= ``short`` (numbers, or
    one per row), with its rounding (``int(x * factor + 0.5)``): the same float operations, vectorised."""
    h, w = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
    factor = np.minimum(long / np.maximum(h, w), short / np.minimum(h, w))
    return np.stack([(h * factor + 0.5).astype(np.int64), (w * factor + 0.5).astype(np.int64)], axis=1)


def output_sizes(transform: Any, sizes: np.ndarray) -> np.ndarray:
    """The sizes ``transform`` can output from ``sizes``: its ``output_sizes`` method, a v2 Compose's chain,
    or torchvision's rule for the v2 transforms that have one."""
    own = getattr(transform, "output_sizes", None)
    if callable(own):
        return unique(own(sizes))
    name = type(transform).__name__
    module = type(transform).__module__ or ""
    if module.startswith("torchvision.transforms"):
        if name == "Compose":
            return chain(transform.transforms, sizes)
        if name in _SAME_SIZE:
            return sizes
        if name == "RandomApply":
            return unique(np.concatenate([sizes, chain(transform.transforms, sizes)]))
        if name == "RandomChoice":
            return unique(np.concatenate([output_sizes(t, sizes) for t in transform.transforms]))
        if name in ("RandomResizedCrop", "CenterCrop", "RandomCrop"):  # the crop is this size, padded if need be
            return _fixed(transform.size)
        if name == "Resize":
            return unique(_tv_resize(transform, sizes))
    raise CannotDerive(f"{getattr(transform, '__name__', name)} does not say which image sizes it outputs")


def chain(transforms: Iterable[Callable], sizes: np.ndarray) -> np.ndarray:
    """The sizes a sequence of transforms outputs, each applied to what the one before can output."""
    for t in transforms:
        sizes = output_sizes(t, sizes)
    return sizes


def _fixed(size: Any) -> np.ndarray:
    h, w = (size, size) if isinstance(size, int) else (tuple(size) * 2)[:2]
    return np.asarray([[h, w]], dtype=np.int64)


def _tv_resize(t: Any, sizes: np.ndarray) -> np.ndarray:
    """torchvision's own output size of its Resize, for each distinct input size."""
    from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

    return np.asarray([_compute_resized_output_size((int(h), int(w)), t.size, t.max_size) for h, w in sizes],
                      dtype=np.int64).reshape(-1, 2)
