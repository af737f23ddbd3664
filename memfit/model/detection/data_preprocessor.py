"""DetDataPreprocessor: a pseudo_collate detection batch -> a normalised, padded image tensor on the device.

MMDetection's DetDataPreprocessor on memfit's plain-dict samples: images of different sizes (uint8,
as the loader packs them, so the host-to-device copy moves a quarter of the bytes) are cast to
float, normalised and padded at the bottom/right to a common size, a multiple of
``pad_size_divisor``. :func:`padding_masks` gives the DETR-style mask of the padding.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memfit.errors import ConfigError
from memfit.model.base import BaseDataPreprocessor
from memfit.registry import MODELS


@MODELS.register()
class DetDataPreprocessor(BaseDataPreprocessor):
    """``{'inputs': [uint8 [3, H, W], ...], 'data_samples': [dict, ...]}`` -> ``{'inputs': float [B, 3, Hp, Wp],
    'data_samples': [...]}``: ``(x - mean) / std``, then ``pad_value`` at the bottom/right up to the
    batch's largest height and width rounded up to ``pad_size_divisor``. Each data sample gets
    ``batch_input_shape = pad_shape = (Hp, Wp)``; its tensors are moved to the device.

    memfit's LoadImageFromFile decodes RGB, so ``bgr_to_rgb``/``rgb_to_bgr`` (either one swaps the
    channels) stay False for models trained on RGB; MMDetection configs set ``bgr_to_rgb=True``
    because mmcv decodes BGR. ``batch_augments``: callables (or MODELS configs) called as
    ``inputs, data_samples = aug(inputs, data_samples)`` in training only. A stacked ``inputs``
    tensor (default_collate) is accepted too.
    """

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 bgr_to_rgb: bool = False, rgb_to_bgr: bool = False, pad_size_divisor: int = 1,
                 pad_value: float = 0, non_blocking: bool | None = None,
                 batch_augments: Sequence[dict | Callable] | None = None) -> None:
        super().__init__(non_blocking=non_blocking)
        if (mean is None) != (std is None):
            raise ConfigError("DetDataPreprocessor: set both mean and std, or neither")
        if bgr_to_rgb and rgb_to_bgr:
            raise ConfigError("DetDataPreprocessor: bgr_to_rgb and rgb_to_bgr cannot both be True")
        if bgr_to_rgb:
            logging.getLogger("memfit").warning(
                "DetDataPreprocessor: bgr_to_rgb=True swaps memfit's RGB images to BGR (mmcv decodes BGR, memfit "
                "decodes RGB): set bgr_to_rgb=False for a model trained on RGB")
        if int(pad_size_divisor) < 1:
            raise ConfigError(f"DetDataPreprocessor: pad_size_divisor={pad_size_divisor} must be >= 1")
        self.normalize = mean is not None
        if self.normalize:
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1), persistent=False)
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(-1, 1, 1), persistent=False)
        self.swap_channels = bool(bgr_to_rgb or rgb_to_bgr)
        self.pad_size_divisor = int(pad_size_divisor)
        self.pad_value = float(pad_value)
        self.batch_augments = [MODELS.build(a, key="data_preprocessor.batch_augments") if isinstance(a, dict) else a
                               for a in (batch_augments or [])]

    def forward(self, data: dict, training: bool = False) -> dict[str, Any]:
        data = self.cast_data(data)  # uint8 to the device first: a quarter of float32's bytes
        images = data["inputs"]
        if isinstance(images, torch.Tensor):
            images = list(images.unbind(0)) if images.dim() == 4 else [images]
        samples = [dict(s) for s in data.get("data_samples") or [{} for _ in images]]
        h = max(img.shape[-2] for img in images)
        w = max(img.shape[-1] for img in images)
        hp = math.ceil(h / self.pad_size_divisor) * self.pad_size_divisor
        wp = math.ceil(w / self.pad_size_divisor) * self.pad_size_divisor
        batch = images[0].new_full((len(images), images[0].shape[0], hp, wp), self.pad_value, dtype=torch.float32)
        for out, img in zip(batch, images):
            img = img.float()
            if self.swap_channels:
                img = img.flip(0)
            if self.normalize:
                img = (img - self.mean) / self.std
            out[:, : img.shape[-2], : img.shape[-1]] = img
        for s in samples:
            s["batch_input_shape"] = s["pad_shape"] = (hp, wp)
        if training:
            for aug in self.batch_augments:
                batch, samples = aug(batch, samples)
        return {"inputs": batch, "data_samples": samples}


def padding_masks(data_samples: Sequence[dict], shape: tuple[int, int],
                  device: torch.device | str | None = None) -> torch.Tensor:
    """bool ``[B, Hp, Wp]``: True on the padding, False on each image's ``img_shape`` (top-left), as
    MMDetection's DETR-family models build their ``masks``."""
    masks = torch.ones(len(data_samples), *shape, dtype=torch.bool, device=device)
    for mask, sample in zip(masks, data_samples):
        h, w = sample["img_shape"]
        mask[:h, :w] = False
    return masks
