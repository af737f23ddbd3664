"""DefaultSampler / InfiniteSampler: bijective per-position shuffle, rank shards, exact resume."""

from __future__ import annotations

import pickle
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch

from memfit.data.sampler import DefaultSampler, FeistelPermutation, InfiniteSampler, SampleKey, sample_seed
from memfit.errors import CheckpointError, ConfigError
from memfit.registry import DATA_SAMPLERS


def ints(keys) -> list[int]:
    return [int(k) for k in keys]


def epoch_order(n: int, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> list[int]:
    s = DefaultSampler(range(n), shuffle=shuffle, seed=seed, num_replicas=1, rank=0)
    s.set_epoch(epoch)
    return ints(s)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1023, 1024, 1025])
@pytest.mark.parametrize("key", [0, 1, 2**63 + 5])
def test_feistel_is_a_bijection(n, key):
    out = FeistelPermutation(n, key)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_feistel_is_per_position():
    """Evaluating any subset of positions agrees with evaluating all of them."""
    perm = FeistelPermutation(1025, 7)
    full = perm(np.arange(1025))
    picks = np.array([1024, 3, 500, 0])
    assert perm(picks).tolist() == full[picks].tolist()


def test_shuffle_looks_random_and_changes_with_epoch_and_seed():
    n = 1000
    a = epoch_order(n, seed=0, epoch=0)
    # no linear trend between position and index, and nearly every element moves
    assert abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.1
    assert sum(i == p for p, i in enumerate(a)) < 10
    for other in (epoch_order(n, seed=0, epoch=1), epoch_order(n, seed=1, epoch=0)):
        assert sum(x == y for x, y in zip(a, other)) < 10
    assert epoch_order(n, seed=0, epoch=0) == a  # and it is deterministic


def test_first_position_is_uniform_over_keys():
    """Across 2000 keys the index at position 0 of a 10-element shuffle is ~uniform (chi^2, 9 dof)."""
    counts = np.bincount([FeistelPermutation(10, k)(np.array([0]))[0] for k in range(2000)], minlength=10)
    chi2 = ((counts - 200) ** 2 / 200).sum()
    assert chi2 < 27.9  # p = 0.001


def test_no_shuffle_is_identity():
    assert epoch_order(11, shuffle=False) == list(range(11))


@pytest.mark.parametrize("n", [10, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_are_disjoint_and_cover_with_round_up(n, world):
    shards = [ints(DefaultSampler(range(n), seed=3, num_replicas=world, rank=r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank gets the same count
    seen = Counter(i for s in shards for i in s)
    assert set(seen) == set(range(n))
    pad = -n % world
    assert sum(c - 1 for c in seen.values()) == pad  # duplicates are exactly the padding
    # interleaving the shards gives the single-process order (then the wrap-around padding)
    inter = [shards[p % world][p // world] for p in range(n)]
    assert inter == epoch_order(n, seed=3)


@pytest.mark.parametrize("world", [2, 3])
def test_shards_partition_without_round_up(world):
    n = 1001
    shards = [
        ints(DefaultSampler(range(n), seed=3, round_up=False, num_replicas=world, rank=r))
        for r in range(world)
    ]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))


def test_resume_at_consumed_yields_exactly_the_rest():
    n = 1000
    full = epoch_order(n, seed=5, epoch=2)
    for k in (0, 1, 256, 999, 1000):
        s = DefaultSampler(range(n), seed=123, num_replicas=1, rank=0)  # seed comes from the state
        s.load_state_dict({"epoch": 2, "consumed": k, "seed": 5, "shuffle": True, "num_samples": n})
        assert ints(s) == full[k:]
        assert len(s) == n - k


def _run(n: int, world: int, state: dict, steps: int | None, batch: int) -> tuple[list[int], dict]:
    """Train ``steps`` iterations (all remaining if None) at ``world`` ranks from ``state``."""
    samplers = [DefaultSampler(range(n), seed=0, num_replicas=world, rank=r) for r in range(world)]
    for s in samplers:
        s.load_state_dict(state)
    iters = [iter(s) for s in samplers]
    remaining = len(samplers[0])
    steps = -(-remaining // batch) if steps is None else steps
    seen = []
    for _ in range(steps):
        for it in iters:
            seen += ints(k for _, k in zip(range(batch), it))
        for s in samplers:
            s.advance(batch * world)
    return seen, samplers[0].state_dict()


@pytest.mark.parametrize("n", [1000, 1003])
@pytest.mark.parametrize("new_world", [1, 3, 2])
def test_resume_at_another_world_size(n, new_world):
    start = DefaultSampler(range(n), seed=0, num_replicas=1, rank=0).state_dict()
    before, state = _run(n, world=2, state=start, steps=7, batch=16)
    assert state["consumed"] == 7 * 16 * 2
    after, _ = _run(n, world=new_world, state=state, steps=None, batch=16)
    order, k = epoch_order(n, seed=0), len(before)
    assert sorted(before) == sorted(order[:k])
    # exactly the unseen samples, plus round-up padding that wraps to the start of the order
    pad = len(after) - (n - k)
    assert 0 <= pad < new_world
    assert Counter(after) == Counter(order[k:] + order[:pad])
    assert set(before + after) == set(range(n))


def test_infinite_sampler_rolls_epochs():
    n = 10
    s = InfiniteSampler(range(n), seed=4, num_replicas=1, rank=0)
    it = iter(s)
    stream = ints(next(it) for _ in range(3 * n))
    assert [stream[e * n : (e + 1) * n] for e in range(3)] == [epoch_order(n, 4, e) for e in range(3)]
    s.advance(25)
    assert (s.epoch, s.consumed) == (2, 5)
    s.set_epoch(0)  # a no-op: the epoch follows from the samples consumed
    resumed = InfiniteSampler(range(n), seed=0, num_replicas=1, rank=0)
    resumed.load_state_dict(s.state_dict())
    it = iter(resumed)
    assert ints(next(it) for _ in range(5)) == stream[25:]


def test_infinite_sampler_shards_the_stream():
    n, world = 7, 3
    its = [iter(InfiniteSampler(range(n), seed=1, num_replicas=world, rank=r)) for r in range(world)]
    per_rank = [ints(next(it) for _ in range(14)) for it in its]
    stream = [per_rank[p % world][p // world] for p in range(42)]
    assert [sorted(stream[e * n : (e + 1) * n]) for e in range(6)] == [list(range(n))] * 6


def test_state_dict_is_plain_and_loads_weights_only(tmp_path):
    s = DefaultSampler(range(50), seed=9, num_replicas=2, rank=1)
    s.set_epoch(3)
    s.advance(8)
    sd = s.state_dict()
    assert sd == {"epoch": 3, "consumed": 8, "seed": 9, "shuffle": True, "num_samples": 50}
    assert all(type(v) in (int, bool) for v in sd.values())
    torch.save(sd, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == sd


def test_load_state_dict_rejects_other_dataset_length():
    s = DefaultSampler(range(50))
    with pytest.raises(CheckpointError, match="50 samples but this one has 40"):
        DefaultSampler(range(40)).load_state_dict(s.state_dict())
    with pytest.raises(CheckpointError, match="missing"):
        s.load_state_dict({"epoch": 0})


def test_set_epoch_resets_only_on_change_and_len_shrinks():
    s = DefaultSampler(range(100), num_replicas=2, rank=0)
    assert len(s) == s.samples_per_epoch == 50
    s.advance(20)
    s.set_epoch(0)
    assert (s.consumed, len(s)) == (20, 40)
    s.set_epoch(1)
    assert (s.epoch, s.consumed, len(s)) == (1, 0, 50)


def test_bounded_memory_on_a_billion_samples():
    """The first keys of a 10**9-sample epoch are computed without building the permutation."""
    s = DefaultSampler(range(10**9), seed=1, num_replicas=8, rank=5)
    s.advance(10**8)
    tracemalloc.start()
    keys = ints(k for _, k in zip(range(1000), s))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(keys)) == 1000 and max(keys) < 10**9
    assert peak < 4 * 2**20  # a materialised permutation would take 8 GB


def test_sample_keys_carry_stable_seeds_and_pickle():
    keys = list(DefaultSampler(range(20), seed=2, num_replicas=1, rank=0))
    assert all(isinstance(k, SampleKey) and k.seed == sample_seed(2, 0, int(k)) for k in keys)
    assert len({k.seed for k in keys}) == 20
    assert sample_seed(2, 1, 3) != sample_seed(2, 0, 3) != sample_seed(3, 0, 3)
    k = pickle.loads(pickle.dumps(keys[0]))
    assert (type(k), int(k), k.seed) == (SampleKey, int(keys[0]), keys[0].seed)
    assert 0 <= k.seed < 2**63


def test_registered_and_validated():
    assert DATA_SAMPLERS.get("DefaultSampler") is DefaultSampler
    assert DATA_SAMPLERS.get("InfiniteSampler") is InfiniteSampler
    with pytest.raises(ConfigError, match="rank=2 must be in"):
        DefaultSampler(range(4), num_replicas=2, rank=2)
