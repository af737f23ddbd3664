"""DetDataPreprocessor: normalise, pad to a multiple of the divisor, shapes in the data samples; padding_masks."""

from __future__ import annotations

import pytest
import torch

from memfit.errors import ConfigError
from memfit.model.detection.data_preprocessor import DetDataPreprocessor, padding_masks
from memfit.registry import MODELS, pseudo_collate

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    items = [
        {"inputs": torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g),
         "data_samples": dict(img_shape=(h, w), gt_instances=dict(bboxes=torch.zeros(k, 4),
                                                                  labels=torch.zeros(k, dtype=torch.int64)))}
        for h, w, k in [(50, 70, 2), (64, 33, 0)]
    ]
    return pseudo_collate(items)


def test_normalises_and_pads_to_the_divisor():
    batch = _batch()
    pre = MODELS.build(dict(type="DetDataPreprocessor", mean=MEAN, std=STD, pad_size_divisor=32, pad_value=0))
    out = pre(batch, False)
    x = out["inputs"]
    assert x.shape == (2, 3, 64, 96) and x.dtype == torch.float32  # max (64, 70) rounded up to 32
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    for i, img in enumerate(batch["inputs"]):
        h, w = img.shape[-2:]
        torch.testing.assert_close(x[i, :, :h, :w], (img.float() - mean) / std)
        assert (x[i, :, h:, :] == 0).all() and (x[i, :, :, w:] == 0).all()
    for s in out["data_samples"]:
        assert s["batch_input_shape"] == s["pad_shape"] == (64, 96)
    assert "batch_input_shape" not in batch["data_samples"][0]  # the loader's dicts are left as they were
    assert out["data_samples"][0]["gt_instances"]["bboxes"].shape == (2, 4)


def test_channel_swap_pad_value_stacked_input_and_batch_augments():
    img = torch.arange(3 * 2 * 3, dtype=torch.uint8).view(1, 3, 2, 3)  # a default_collate tensor
    pre = DetDataPreprocessor(bgr_to_rgb=True, pad_size_divisor=4, pad_value=-1)
    x = pre({"inputs": img, "data_samples": [dict(img_shape=(2, 3))]})["inputs"]
    assert x.shape == (1, 3, 4, 4)
    assert torch.equal(x[0, :, :2, :3], img[0].flip(0).float()) and (x[0, :, 2:] == -1).all()
    calls = []

    def aug(inputs, samples):
        calls.append(inputs.shape)
        return inputs * 2, samples

    pre = DetDataPreprocessor(batch_augments=[aug])
    assert torch.equal(pre({"inputs": img}, False)["inputs"], img.float()) and not calls
    assert torch.equal(pre({"inputs": img}, True)["inputs"], 2 * img.float()) and calls == [(1, 3, 2, 3)]
    with pytest.raises(ConfigError, match="set both mean and std"):
        DetDataPreprocessor(mean=MEAN)


def test_padding_masks_are_true_on_padding():
    samples = [dict(img_shape=(2, 3)), dict(img_shape=(4, 1))]
    masks = padding_masks(samples, (4, 4))
    assert masks.dtype == torch.bool and masks.tolist() == [
        [[False, False, False, True], [False, False, False, True], [True] * 4, [True] * 4],
        [[False, True, True, True]] * 4,
    ]
