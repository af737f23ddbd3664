"""SeededDataset: an item's augmentation depends only on (seed, epoch, index), not on how it is read."""

from __future__ import annotations

import random

import numpy as np
import torch

from memfit.data import DefaultSampler, SampleKey, SeededDataset, ShapesDataset, build_dataloader, sample_seed

AUGMENT = [
    dict(type="RandomResizedCrop", size=24, scale=(0.3, 1.0)),
    dict(type="RandomHorizontalFlip"),
    dict(type="ToDtype", dtype="float32", scale=True),
]


class ThreeRngs:
    """Draws from torch, Python's random and numpy's global RNG, as user transforms do."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        return i, torch.rand(()).item(), random.random(), float(np.random.rand())


def test_same_key_same_sample_and_caller_rng_untouched():
    ds = SeededDataset(ThreeRngs())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = (torch.rand(()).item(), random.random(), float(np.random.rand()))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    a = ds[SampleKey(3, 42)]
    b = ds[SampleKey(3, 42)]
    batch = ds.__getitems__([SampleKey(1, 7), SampleKey(3, 42)])  # DataLoader's batched fetch
    assert a == b == batch[1] and batch[0][1:] != a[1:]
    assert ds[SampleKey(3, 43)][1:] != a[1:]
    # the caller's three streams continue as if no item had been read
    assert (torch.rand(()).item(), random.random(), float(np.random.rand())) == expected


def test_plain_int_keys_pass_through():
    ds = SeededDataset(ThreeRngs())
    assert ds[2][0] == 2 and ds[2][1:] != ds[2][1:]  # unseeded: global RNG as usual
    assert ds.__getitems__([2, 2])[0][1:] != ds.__getitems__([2, 2])[0][1:]
    assert len(ds) == 8


def test_attributes_forward_to_the_wrapped_dataset():
    shapes = ShapesDataset(num_samples=4, image_size=16)
    assert SeededDataset(shapes).metainfo == shapes.metainfo


def _epoch(num_workers: int, consumed: int = 0, epoch: int = 1) -> list[torch.Tensor]:
    cfg = dict(
        batch_size=4,
        dataset=dict(type="ShapesDataset", num_samples=32, image_size=32, transform=AUGMENT),
        num_workers=num_workers,
    )
    loader = build_dataloader(cfg, seed=7)
    loader.sampler.set_epoch(epoch)
    loader.sampler.advance(consumed)
    return [b["img"] for b in loader]


def test_augmentation_same_in_order_after_skip_and_in_workers():
    full = _epoch(num_workers=0)
    assert not torch.equal(full[0][0], full[0][1])
    resumed = _epoch(num_workers=0, consumed=12)  # skip three batches
    workers = _epoch(num_workers=2)
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(full[3:], resumed))
    assert all(torch.equal(a, b) for a, b in zip(full, workers))
    # and another epoch augments the same images differently
    assert not any(torch.equal(a, b) for a, b in zip(full, _epoch(num_workers=0, epoch=2)))


def test_key_seed_is_what_the_sampler_derives():
    shapes = ShapesDataset(num_samples=6, image_size=16, transform=AUGMENT)
    keys = list(DefaultSampler(shapes, seed=7, num_replicas=1, rank=0))
    direct = SeededDataset(shapes)[SampleKey(int(keys[0]), sample_seed(7, 0, int(keys[0])))]
    assert torch.equal(SeededDataset(shapes)[keys[0]]["img"], direct["img"])
