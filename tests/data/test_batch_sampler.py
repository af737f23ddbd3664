"""AspectRatioBatchSampler: MMDetection's batches (one orientation per batch, the rest batched together at the end
of the epoch) in the same order, per rank; a resumed epoch yields exactly the batches not yet trained; a
dataloader config builds it as MMEngine does, and what it cannot run is refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from memfit.data import AspectRatioBatchSampler, DefaultSampler, build_dataloader
from memfit.errors import ConfigError


class Sized:
    """Images of seeded random orientation; ``get_data_info`` as MMEngine's datasets give it."""

    def __init__(self, n: int = 37) -> None:
        g = torch.Generator().manual_seed(1)
        self.hw = torch.randint(50, 150, (n, 2), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.hw)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2,), float(i)), torch.tensor(i)

    def get_data_info(self, i: int) -> dict:
        return dict(height=self.hw[i][0], width=self.hw[i][1])


def mmdetection_batches(order: list[int], dataset: Sized, batch_size: int, drop_last: bool) -> list[list[int]]:
    """MMDetection's AspectRatioBatchSampler.__iter__ over one epoch's order, as it is written there."""
    buckets: list[list[int]] = [[], []]
    out = []
    for idx in order:
        info = dataset.get_data_info(idx)
        bucket = buckets[0 if info["width"] < info["height"] else 1]
        bucket.append(idx)
        if len(bucket) == batch_size:
            out.append(bucket[:])
            del bucket[:]
    left = buckets[0] + buckets[1]
    while left:
        if len(left) <= batch_size:
            if not drop_last:
                out.append(left[:])
            left = []
        else:
            out.append(left[:batch_size])
            left = left[batch_size:]
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("batch_size, drop_last", [(2, False), (3, False), (3, True), (4, True)])
def test_batches_are_mmdetections_and_a_resumed_epoch_yields_exactly_the_rest(world, batch_size, drop_last):
    dataset = Sized()
    for rank in range(world):
        def sampler(consumed: int = 0, rank: int = rank) -> DefaultSampler:
            s = DefaultSampler(dataset, shuffle=True, seed=3, num_replicas=world, rank=rank)
            s.set_epoch(2)
            s.consumed = consumed
            return s

        order = [int(k) for k in sampler()]
        expected = mmdetection_batches(order, dataset, batch_size, drop_last)
        batches = AspectRatioBatchSampler(sampler(), batch_size, drop_last, dataset=dataset)
        assert [[int(k) for k in b] for b in batches] == expected
        assert len(batches) == len(expected) == (len(order) // batch_size if drop_last
                                                 else math.ceil(len(order) / batch_size))
        assert any(len({dataset.hw[i][1] < dataset.hw[i][0] for i in b}) == 1 and len(b) == batch_size
                   for b in expected)
        for trained in range(len(expected) + 1):
            resumed = AspectRatioBatchSampler(sampler(trained * batch_size * world), batch_size, drop_last,
                                              dataset=dataset)
            assert [[int(k) for k in b] for b in resumed] == expected[trained:]
            assert len(resumed) == len(expected) - trained


def _loader_cfg(dataset, **extra) -> dict:
    return dict(batch_size=3, dataset=dataset, sampler=dict(type="DefaultSampler", shuffle=True),
                batch_sampler=dict(type="AspectRatioBatchSampler"), num_workers=0, **extra)


def test_a_dataloader_config_builds_it_as_mmengine_does():
    dataset = Sized()
    loader = build_dataloader(_loader_cfg(dataset), seed=5)
    assert isinstance(loader.batch_sampler, AspectRatioBatchSampler) and loader.batch_sampler.batch_size == 3
    order = [int(k) for k in DefaultSampler(dataset, shuffle=True, seed=5)]
    first = next(iter(loader))
    assert first[1].tolist() == mmdetection_batches(order, dataset, 3, False)[0]
    assert len(loader) == math.ceil(len(dataset) / 3)


@pytest.mark.parametrize(("extra", "dataset", "message"), [
    (dict(sampler=dict(type="InfiniteSampler")), Sized(), r"train_dataloader\.batch_sampler: AspectRatioBatchSampler "
                                                          r"batches an epoch's order, which only DefaultSampler has "
                                                          r"\(got InfiniteSampler\)"),
    (dict(drop_last=True), Sized(), r"train_dataloader: drop_last with a batch_sampler: give it to the batch sampler "
                                    r"\(train_dataloader\.batch_sampler\.drop_last=True\)"),
    (dict(), [(torch.zeros(2), torch.tensor(0))] * 6, r"train_dataloader\.batch_sampler: AspectRatioBatchSampler "
                                                      r"needs each image's width and height from the dataset"),
    (dict(batch_sampler=object()), Sized(), r"train_dataloader\.batch_sampler: give "
                                            r"dict\(type='AspectRatioBatchSampler'\), not object"),
])
def test_what_it_cannot_run_is_one_line_naming_the_key(extra, dataset, message):
    cfg = {**_loader_cfg(dataset), **extra}
    with pytest.raises(ConfigError, match=message) as e:
        build_dataloader(cfg, seed=0, key="train_dataloader")
    assert "\n" not in str(e.value)
