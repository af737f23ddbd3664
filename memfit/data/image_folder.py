"""ImageFolder classification data (``root/<class>/<image>``) in memfit's sample format.

torchvision's ``ImageFolder`` finds the files and classes; this subclass decodes to a uint8 CHW
tensor so pipelines see the same input as with the shapes dataset, and returns
``{'img', 'label'}`` for ``model.forward(**batch)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchvision
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from memfit.data.transforms import build_transforms, default_image_transform
from memfit.errors import ConfigError, first_line
from memfit.registry import DATASETS


def read_image_rgb(path: str) -> torch.Tensor:
    """Decode an image file to a uint8 RGB tensor [3, H, W] (with PIL, as torchvision's default
    loader does; torchvision.io's decoders are deprecated since 0.29)."""
    with Image.open(path) as im:
        return pil_to_tensor(im.convert("RGB"))


@DATASETS.register()
class ImageFolder(torchvision.datasets.ImageFolder):
    """``root/<class_name>/<image>`` files as ``{'img': pipeline(uint8 image), 'label': class index}``.

    ``pipeline`` is a list of transform configs (see :func:`memfit.data.transforms.build_transforms`)
    or a callable; the default converts to float32 in [-1, 1]. Images of different sizes need a
    resize or crop in the pipeline before they can be batched.
    """

    def __init__(self, root: str, pipeline: Sequence[dict | Callable] | Callable | None = None) -> None:
        root = os.path.expanduser(str(root))
        if not os.path.isdir(root):
            raise ConfigError(
                f"ImageFolder: root={root!r} is not a folder: point dataset.root at a folder of class folders"
            )
        try:
            super().__init__(root, loader=read_image_rgb)
        except FileNotFoundError as e:  # no class folders, or no image files in them
            raise ConfigError(f"ImageFolder: root={root!r}: {first_line(e)} Put the images in "
                              f"{os.path.join(root, '<class name>', '<image>')}") from None
        self.pipeline = default_image_transform() if pipeline is None else build_transforms(pipeline)
        self.metainfo = {"classes": tuple(self.classes)}

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.samples[index]
        img = self.loader(path)
        if self.pipeline is not None:
            img = self.pipeline(img)
        return {"img": img, "label": label}
