"""build_transforms: torchvision v2 pipelines from config dicts."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T

from memfit.data.transforms import build_transforms, default_image_transform
from memfit.errors import ConfigError


def test_dicts_build_the_torchvision_pipeline():
    img = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8)
    cfg = [
        dict(type="Resize", size=32),
        dict(type="CenterCrop", size=32),
        dict(type="ToDtype", dtype="torch.float32", scale=True),
        dict(type="Normalize", mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25]),
    ]
    ref = T.Compose(
        [
            T.Resize(32),
            T.CenterCrop(32),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize([0.5] * 3, [0.25] * 3),
        ]
    )
    out = build_transforms(cfg)(img)
    assert out.dtype == torch.float32 and out.shape == (3, 32, 32)
    assert torch.equal(out, ref(img))


def test_callables_and_empty():
    flip = T.RandomHorizontalFlip(p=1.0)
    img = torch.arange(6, dtype=torch.uint8).reshape(1, 2, 3)
    assert torch.equal(build_transforms([flip])(img), img.flip(-1))
    assert build_transforms([]) is None and build_transforms(None) is None


def test_default_maps_uint8_to_minus_one_one():
    out = default_image_transform()(
        torch.tensor([0, 255], dtype=torch.uint8).reshape(1, 1, 2).repeat(3, 1, 1)
    )
    assert out.dtype == torch.float32 and out.min() == -1 and out.max() == 1


def test_errors_name_the_entry_and_the_fix():
    with pytest.raises(ConfigError, match="did you mean 'RandomResizedCrop'"):
        build_transforms([dict(type="RandomResizeCrop", size=8)])
    with pytest.raises(ConfigError, match=r"pipeline\[1\].*unknown key 'szie'.*'size'"):
        build_transforms([dict(type="RandomHorizontalFlip"), dict(type="Resize", szie=8)])
    with pytest.raises(ConfigError, match="dtype='float23' is not a torch dtype"):
        build_transforms([dict(type="ToDtype", dtype="float23")])
