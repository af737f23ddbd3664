"""build_dataloader: MMEngine-style configs, live DataLoaders (the seeds' plain list), errors, resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SubsetRandomSampler

from memfit.data import DefaultSampler, InfiniteSampler, SeededDataset, ShapesDataset, build_dataloader
from memfit.errors import ConfigError

SHAPES = dict(type="ShapesDataset", num_samples=20, image_size=16)


def test_config_builds_a_resumable_loader():
    loader = build_dataloader(
        dict(batch_size=4, dataset=SHAPES, num_workers=0, persistent_workers=True), seed=1
    )
    assert isinstance(loader.sampler, DefaultSampler) and loader.sampler.shuffle and loader.sampler.seed == 1
    assert isinstance(loader.dataset, SeededDataset)
    batch = next(iter(loader))
    assert batch["img"].shape == (4, 3, 16, 16) and batch["label"].shape == (4,)
    assert len(loader) == 5


def test_rank_sharding_through_the_config():
    cfg = dict(batch_size=3, dataset=SHAPES, sampler=dict(type="DefaultSampler", shuffle=False))
    shards = [build_dataloader(cfg, seed=0, rank=r, world_size=2).sampler for r in range(2)]
    assert [list(map(int, s)) for s in shards] == [list(range(0, 20, 2)), list(range(1, 20, 2))]


def test_resume_continues_with_the_next_batch():
    cfg = dict(batch_size=4, dataset=SHAPES)
    full = [b["label"].tolist() for b in build_dataloader(cfg, seed=3)]
    resumed = build_dataloader(cfg, seed=0)
    resumed.sampler.load_state_dict(
        {"epoch": 0, "consumed": 8, "seed": 3, "shuffle": True, "num_samples": 20}
    )
    assert [b["label"].tolist() for b in resumed] == full[2:]


def test_sampler_and_collate_options():
    inf = build_dataloader(dict(batch_size=8, dataset=SHAPES, sampler="InfiniteSampler"), seed=0)
    assert isinstance(inf.sampler, InfiniteSampler)
    it = iter(inf)
    assert sum(len(next(it)["label"]) for _ in range(4)) == 32  # runs past the 20-sample epoch
    seeded = build_dataloader(
        dict(batch_size=2, dataset=SHAPES, sampler=dict(type="DefaultSampler", seed=None)), seed=5
    )
    assert seeded.sampler.seed == 5  # seed=None means the run's seed
    lists = build_dataloader(
        dict(batch_size=2, dataset=SHAPES, collate_fn=dict(type="pseudo_collate")), seed=0
    )
    batch = next(iter(lists))  # MMEngine's pseudo_collate: dict samples -> a dict of lists, nothing stacked
    assert set(batch) == {"img", "label", "boxes", "labels"} and len(batch["img"]) == 2
    assert isinstance(batch["img"], list) and batch["label"] == [int(b) for b in batch["label"]]
    mine = build_dataloader(dict(batch_size=2, dataset=SHAPES, collate_fn=len), seed=0)
    assert next(iter(mine)) == 2
    ds = ShapesDataset(num_samples=10, image_size=16)
    torch_dist = build_dataloader(
        dict(batch_size=1, dataset=ds, sampler=dict(type=DistributedSampler)), seed=0, world_size=2
    )
    assert isinstance(torch_dist.sampler, DistributedSampler) and len(torch_dist) == 5


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (dict(batchsize=2, dataset=SHAPES), "dataloader: unknown key 'batchsize': did you mean 'batch_size'"),
        (dict(dataset=SHAPES), "dataloader: missing 'batch_size'"),
        (dict(batch_size=0, dataset=SHAPES), "batch_size=0 must be a positive int"),
        (dict(batch_size=2, dataset=SHAPES, batch_sampler=dict(type="x")), "unknown sampler type 'x'"),
        (dict(batch_size=2, dataset=SHAPES, batch_sampler=dict(type="DefaultSampler")),
         "dataloader.batch_sampler: DefaultSampler is not a batch sampler (one of: AspectRatioBatchSampler); a "
         "sampler goes in dataloader.sampler"),
        (
            dict(batch_size=2, dataset=SHAPES, sampler=dict(type="DefaultSample")),
            "did you mean 'DefaultSampler'",
        ),
        (
            dict(batch_size=2, dataset=SHAPES, sampler=dict(type="DefaultSampler", shufle=1)),
            "unknown key 'shufle'",
        ),
        (dict(batch_size=2, dataset=dict(type="ShapeDataset")), "unknown dataset type 'ShapeDataset'"),
        (
            dict(batch_size=2, dataset=SHAPES, collate_fn=dict(type="default_colate")),
            "did you mean 'default_collate'",
        ),
    ],
)
def test_config_errors_are_one_line_with_the_fix(cfg, message):
    with pytest.raises(ConfigError) as err:
        build_dataloader(cfg, seed=0, key="dataloader")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_seed_plain_list_dataloader_is_made_resumable():
    """The seeds' ``DataLoader([(ones, ones)] * 50, batch_size=2)``."""
    train_dataset = [(torch.ones(1, 1), torch.ones(1, 1))] * 50
    loader = build_dataloader(DataLoader(train_dataset, batch_size=2), seed=0)
    assert isinstance(loader.sampler, DefaultSampler) and not loader.sampler.shuffle
    batches = list(loader)
    assert len(batches) == 25 and all(x.shape == (2, 1, 1) and y.shape == (2, 1, 1) for x, y in batches)


def test_live_loader_keeps_its_options_and_shuffle():
    ds = ShapesDataset(num_samples=12, image_size=16)
    live = DataLoader(ds, batch_size=5, shuffle=True, drop_last=True, collate_fn=list)
    loader = build_dataloader(live, seed=2, rank=1, world_size=2)
    s = loader.sampler
    assert isinstance(s, DefaultSampler) and s.shuffle and (s.seed, s.rank, s.world_size) == (2, 1, 2)
    assert (loader.batch_size, loader.drop_last, loader.collate_fn) == (5, True, list)
    assert len(loader) == 1  # 6 samples on this rank, drop_last


def test_live_loader_with_custom_sampler_is_left_alone():
    ds = ShapesDataset(num_samples=12, image_size=16)
    custom = DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler([1, 2, 3]))
    assert build_dataloader(custom, seed=0) is custom
    with_batch_sampler = DataLoader(ds, batch_sampler=[[0, 1], [2, 3]])
    assert build_dataloader(with_batch_sampler, seed=0) is with_batch_sampler


def test_pseudo_collate_is_mmengines_one_level_transpose():
    from collections import namedtuple

    from memfit.registry import pseudo_collate

    a, b = torch.zeros(3, 4, 5), torch.ones(3, 6, 2)
    batch = pseudo_collate([{"inputs": a, "data_samples": {"img_id": 1}}, {"inputs": b, "data_samples": {"img_id": 2}}])
    assert batch["inputs"][0] is a and batch["inputs"][1] is b
    assert batch["data_samples"] == [{"img_id": 1}, {"img_id": 2}]  # the sample dicts are kept whole
    assert pseudo_collate([(a, 1), (b, 2)]) == [[a, b], [1, 2]]
    pair = namedtuple("pair", "x y")
    assert pseudo_collate([pair(1, 2), pair(3, 4)]) == pair([1, 3], [2, 4])
    assert pseudo_collate([a, b])[1] is b
    with pytest.raises(ValueError, match="same length"):
        pseudo_collate([(1, 2), (3,)])


def test_training_stops_its_persistent_workers_when_it_ends(tmp_path):
    import torch.nn.functional as F
    from torch import nn

    from memfit.hooks import Hook
    from memfit.model import BaseModel
    from memfit.runner import Runner

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x, y, mode="tensor"):
            return {"loss": F.cross_entropy(self.fc(x), y)}

    data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(8)]
    runner = Runner(model=Net(), work_dir=str(tmp_path), train_cfg=dict(by_epoch=True, max_epochs=2),
                    train_dataloader=dict(batch_size=4, dataset=data, num_workers=1, persistent_workers=True),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)), default_hooks=dict(checkpoint=None))
    seen = []

    class Watch(Hook):
        def after_train_epoch(self, runner) -> None:
            seen.append(runner.train_dataloader._iterator)

    runner.register_hook(Watch())
    runner.train()
    # Both epochs ran on the same persistent worker, stopped when training ended, not by the garbage collector.
    assert seen[0] is not None and seen[0] is seen[1]
    assert runner.train_dataloader._iterator is None and not seen[0]._workers_status[0]
