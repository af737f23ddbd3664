"""Resumable, rank-sharded samplers whose global order is computed per position.

The order of epoch ``e`` is a keyed pseudorandom permutation of ``range(N)`` that maps a position
``p`` to a dataset index without building the permutation (a Feistel network, below). Two things
follow. Memory is bounded: a rank computes only the indices it reads, in small chunks, never all
``N`` (VISSL's StatefulDistributedSampler goal, for 100M+ image datasets). And the global order does
not depend on the world size: rank ``r`` of ``W`` reads positions ``consumed + r, consumed + r + W,
...``, so a run saved at ``consumed = k`` on 2 ranks continues on 1 or 3 ranks with exactly the
samples not yet seen, and a resume costs the same at iteration 10 or 10 million (nothing is skipped).

Every element is a :class:`SampleKey`: the dataset index (an ``int``) carrying a per-sample seed
derived from ``(seed, epoch, index)``, which :class:`memfit.data.seeded.SeededDataset` uses to make
random augmentation independent of worker assignment and of what was read before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from memfit.dist import get_rank, get_world_size
from memfit.errors import CheckpointError, ConfigError, warn_ignored
from memfit.registry import DATA_SAMPLERS

_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
# Domain-separation tags so the permutation key and the sample seeds never coincide.
_PERM_TAG = 0x5045524D5F4B4559  # "PERM_KEY"
_SEED_TAG = 0x53414D504C455345  # "SAMPLESE"
# Positions are turned into indices this many at a time: large enough that numpy's per-call cost
# vanishes, small enough that a rank never holds more than a few KiB of indices.
_CHUNK = 4096


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-tested 64-bit avalanche hash (vectorised, wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def _as_u64(v: Any) -> np.ndarray:
    """Ints and int arrays as uint64 (negative values in two's complement)."""
    if isinstance(v, (int, np.integer)):
        return np.array([int(v) % (1 << 64)], dtype=_U64)
    a = np.atleast_1d(np.asarray(v))
    return a if a.dtype == _U64 else a.astype(np.int64).view(_U64)


def _hash(*values: Any) -> np.ndarray:
    """Hash a tuple of ints (or broadcastable int arrays) to uint64; order-sensitive."""
    h = np.full(1, _GOLDEN, dtype=_U64)
    for v in values:
        with np.errstate(over="ignore"):
            h = _mix64(h ^ (_as_u64(v) + _U64(_GOLDEN)))
    return h


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of dataset item ``index`` in ``epoch`` of a run seeded with ``seed``.

    A non-negative 63-bit int (valid for ``torch.manual_seed`` and ``random.seed``).
    """
    return int(_sample_seeds(seed, epoch, np.array([index]))[0])


def _sample_seeds(seed: int, epoch: int | np.ndarray, indices: np.ndarray) -> np.ndarray:
    return _hash(_SEED_TAG, seed, epoch, indices) >> _U64(1)


class FeistelPermutation:
    """A keyed bijection of ``range(n)``, evaluated per position without materialising it.

    Written here because no library offers an index-computable shuffle (``torch.randperm`` and
    ``numpy.random.permutation`` build all ``n`` entries). A Feistel network over ``b`` bits, where
    ``2**b`` is the next power of two ``>= n``, is a bijection of ``range(2**b)`` for any round
    function; the halves may differ by one bit (each half-round XORs one half with a hash of the
    other, which is invertible whatever the widths). Cycle-walking (re-applying the network until
    the value falls below ``n``) restricts it to a bijection of ``range(n)``; since ``2**b < 2n`` a
    position needs fewer than two applications on average.
    """

    def __init__(self, n: int, key: int, rounds: int = 4) -> None:
        if n < 1:
            raise ValueError(f"FeistelPermutation needs n >= 1, got {n}")
        self.n = n
        bits = (n - 1).bit_length()
        self._lo_bits = _U64(bits // 2)
        self._lo_mask = _U64((1 << (bits // 2)) - 1)
        self._hi_mask = _U64((1 << (bits - bits // 2)) - 1)
        # 4 double rounds (8 half-rounds) with independent round keys: Luby-Rackoff needs 3-4
        # rounds for a pseudorandom permutation; the hash is cheap so we take the safe side.
        self._round_keys = list(_hash(key, np.arange(2 * rounds)))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        lo, hi = x & self._lo_mask, x >> self._lo_bits
        for k_hi, k_lo in zip(self._round_keys[0::2], self._round_keys[1::2]):
            hi = hi ^ (_mix64(lo ^ k_hi) & self._hi_mask)
            lo = lo ^ (_mix64(hi ^ k_lo) & self._lo_mask)
        return (hi << self._lo_bits) | lo

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map an int array of positions in ``[0, n)`` to dataset indices (int64)."""
        y = self._encrypt(np.asarray(positions, dtype=np.int64).astype(_U64))
        out = y >= _U64(self.n)
        while out.any():  # cycle-walking
            y[out] = self._encrypt(y[out])
            out = y >= _U64(self.n)
        return y.astype(np.int64)


class SampleKey(int):
    """A dataset index (usable wherever an ``int`` is) that carries its augmentation ``seed``."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SampleKey:
        obj = super().__new__(cls, index)
        obj.seed = seed
        return obj

    def __reduce__(self) -> tuple:  # keep the seed when sent to a DataLoader worker
        return (SampleKey, (int(self), self.seed))

    def __repr__(self) -> str:
        return f"SampleKey({int(self)}, seed={self.seed})"


def _dist_defaults(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    world = get_world_size() if num_replicas is None else int(num_replicas)
    rank = get_rank() if rank is None else int(rank)
    if world < 1:
        raise ConfigError(f"sampler: num_replicas={world} must be >= 1")
    if not 0 <= rank < world:
        raise ConfigError(f"sampler: rank={rank} must be in [0, num_replicas={world})")
    return world, rank


@DATA_SAMPLERS.register()
class DefaultSampler(Sampler[SampleKey]):
    """An epoch sampler that shuffles per position, shards by rank and resumes mid-epoch.

    ``seed`` keys the shuffle and the per-sample augmentation seeds; the runner passes the run's
    seed, and ``None`` means 0 (no broadcast is needed since every rank then agrees). ``round_up``
    pads the last step by wrapping to the start of the order, as ``DistributedSampler`` does, so
    every rank reads the same count. ``num_replicas``/``rank`` default to the process group's.
    The sampler never reads dataset items, only ``len(dataset)``.

    State: ``epoch`` and ``consumed`` (global samples of this epoch already trained on). The train
    loop calls :meth:`advance` after each step with ``batch_size * world_size``; ``__iter__`` starts
    at ``consumed``; ``__len__`` is this rank's remaining count.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int | None = None,
        round_up: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.num_samples = len(dataset)
        self.shuffle = bool(shuffle)
        self.seed = 0 if seed is None else int(seed)
        self.round_up = bool(round_up)
        self.world_size, self.rank = _dist_defaults(num_replicas, rank)
        self.epoch = 0
        self.consumed = 0

    # -- order ---------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> FeistelPermutation | None:
        if not self.shuffle or self.num_samples == 0:
            return None
        return FeistelPermutation(self.num_samples, int(_hash(_PERM_TAG, self.seed, epoch)[0]))

    def indices(self, positions: np.ndarray, epoch: int | None = None) -> np.ndarray:
        """Dataset indices at global ``positions`` of ``epoch`` (default: the current one).

        Positions past the end wrap to the start (the ``round_up`` padding).
        """
        epoch = self.epoch if epoch is None else epoch
        pos = np.asarray(positions, dtype=np.int64) % self.num_samples
        perm = self._permutation(epoch)
        return pos if perm is None else perm(pos)

    def _end(self, consumed: int) -> int:
        """One past the last global position of this epoch (padded so every rank ends together)."""
        remaining = max(self.num_samples - consumed, 0)
        if self.round_up:
            return consumed + math.ceil(remaining / self.world_size) * self.world_size
        return self.num_samples

    def _keys(self, epoch: int | np.ndarray, indices: np.ndarray) -> Iterator[SampleKey]:
        seeds = _sample_seeds(self.seed, epoch, indices)
        yield from map(SampleKey, indices.tolist(), seeds.tolist())

    def __iter__(self) -> Iterator[SampleKey]:
        return self._keys_from(self.consumed)

    def epoch_keys(self) -> Iterator[SampleKey]:
        """This rank's keys of the whole epoch, from its start whatever was consumed (a batch sampler that
        groups them replays the epoch up to where training stopped: :mod:`memfit.data.batch_sampler`)."""
        return self._keys_from(0)

    def _keys_from(self, consumed: int) -> Iterator[SampleKey]:
        first, end, step = consumed + self.rank, self._end(consumed), self.world_size
        epoch = self.epoch
        for start in range(first, end, step * _CHUNK):
            positions = np.arange(start, min(start + step * _CHUNK, end), step, dtype=np.int64)
            yield from self._keys(epoch, self.indices(positions, epoch))

    def __len__(self) -> int:
        return len(range(self.consumed + self.rank, self._end(self.consumed), self.world_size))

    @property
    def samples_per_epoch(self) -> int:
        """This rank's count for a whole epoch (``__len__`` shrinks as the epoch is consumed)."""
        w = self.world_size
        total = math.ceil(self.num_samples / w) * w if self.round_up else self.num_samples
        return len(range(self.rank, total, w))

    # -- state ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Enter ``epoch``; ``consumed`` restarts at 0 only when the epoch changes (so a resumed
        run that re-enters its saved epoch keeps its position)."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0

    def advance(self, n_global: int) -> None:
        """Record that ``n_global`` more samples (over all ranks) were trained on."""
        if int(n_global) < 0:
            raise ValueError(f"advance: n_global={n_global} must be >= 0")
        self.consumed += int(n_global)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/bools: safe for ``weights_only`` checkpoint loading."""
        return {
            "epoch": int(self.epoch),
            "consumed": int(self.consumed),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "num_samples": int(self.num_samples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; its seed and shuffle flag win so the order is the saved one."""
        missing = {"epoch", "consumed", "seed", "shuffle", "num_samples"} - set(state)
        if missing:
            raise CheckpointError(f"sampler state is missing {sorted(missing)}: not a memfit sampler state")
        if int(state["num_samples"]) != self.num_samples:
            raise CheckpointError(
                f"sampler state was saved for a dataset of {state['num_samples']} samples but this one has "
                f"{self.num_samples}: resume with the same dataset or start the epoch afresh"
            )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])


@DATA_SAMPLERS.register()
class InfiniteSampler(DefaultSampler):
    """An endless stream for iteration-based training: epoch after epoch, each freshly shuffled.

    The stream is the concatenation of epochs (no padding is needed since it never ends, so
    ``round_up``, which MMEngine's InfiniteSampler does not take, logs a warning); rank ``r`` reads
    stream positions ``start + r + k*W``.
    :meth:`advance` rolls ``consumed`` over into the next epoch; :meth:`set_epoch` is a no-op, as in
    MMEngine (the epoch follows from the samples consumed). ``__len__`` is one epoch's share per rank,
    a nominal value: iteration never ends.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int | None = None, round_up: bool | None = None,
                 num_replicas: int | None = None, rank: int | None = None) -> None:
        if round_up is not None:
            warn_ignored("InfiniteSampler.round_up", "the stream never ends, so no last step is padded or dropped "
                         "(round_up is DefaultSampler's option)")
        super().__init__(dataset, shuffle, seed, True, num_replicas, rank)

    def set_epoch(self, epoch: int) -> None:
        return None

    def advance(self, n_global: int) -> None:
        super().advance(n_global)
        if self.num_samples:
            self.epoch += self.consumed // self.num_samples
            self.consumed %= self.num_samples

    def __iter__(self) -> Iterator[SampleKey]:
        n = self.num_samples
        if n == 0:
            return
        step = self.world_size
        start = self.epoch * n + self.consumed + self.rank
        # At most one epoch's share per chunk, so a chunk spans at most two epochs.
        count = min(_CHUNK, -(-n // step))
        while True:
            stream = np.arange(start, start + step * count, step, dtype=np.int64)
            start += step * count
            epochs, positions = stream // n, stream % n
            indices = np.empty_like(positions)
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                indices[sel] = self.indices(positions[sel], e)
            yield from self._keys(epochs, indices)

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.world_size)
