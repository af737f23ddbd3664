"""ImageFolder: memfit's dict samples from root/<class>/<image>, and one-line errors."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from memfit.data import build_dataloader
from memfit.errors import ConfigError
from memfit.registry import DATASETS


def test_reads_png_and_bmp_as_dict_samples(tmp_path):
    for cls, value in (("cat", 10), ("dog", 200)):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (10, 12), (value,) * 3).save(tmp_path / cls / "a.png")
        Image.new("RGB", (20, 16), (value,) * 3).save(tmp_path / cls / "b.bmp")
    cfg = dict(type="ImageFolder", root=str(tmp_path), pipeline=[dict(type="Resize", size=(8, 8))])
    ds = DATASETS.build(cfg)
    assert ds.metainfo["classes"] == ("cat", "dog") and len(ds) == 4
    item = ds[3]
    assert item["label"] == 1 and item["img"].shape == (3, 8, 8) and item["img"].dtype == torch.uint8
    assert (item["img"] == 200).all()
    batch = next(iter(build_dataloader(dict(batch_size=4, dataset=cfg), seed=0)))
    assert batch["img"].shape == (4, 3, 8, 8) and sorted(batch["label"].tolist()) == [0, 0, 1, 1]
    default = DATASETS.build(dict(type="ImageFolder", root=str(tmp_path)))[0]["img"]
    assert default.dtype == torch.float32 and default.shape == (3, 12, 10)


def test_missing_or_empty_root_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="root='/no/such/dir' is not a folder") as err:
        DATASETS.build(dict(type="ImageFolder", root="/no/such/dir"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="Couldn't find any class folder"):
        DATASETS.build(dict(type="ImageFolder", root=str(tmp_path)))
