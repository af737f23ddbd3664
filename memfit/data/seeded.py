"""Per-sample seeding of random augmentation, for exact resume with any number of workers.

A DataLoader worker's RNG advances with every item it loads, so the crop a sample receives depends
on which worker loaded it and on what that worker loaded before: a resumed run (fewer items read,
different assignment) would augment differently. :class:`SeededDataset` removes that dependence:
each item is loaded under RNGs seeded from its :class:`~memfit.data.sampler.SampleKey` (derived from
the run seed, the epoch and the index), and the caller's RNG states are restored afterwards.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from memfit.data.sampler import SampleKey


class SeededDataset(Dataset):
    """Wrap ``dataset`` so that ``dataset[SampleKey(i, s)]`` loads item ``i`` with every RNG seeded by ``s``.

    torch's CPU generator, Python's ``random`` and numpy's global RNG are seeded (the sources
    torchvision, timm and user transforms draw from on the CPU) and restored after the item is
    loaded, so the caller's random streams do not depend on data loading. Plain int keys pass
    through unchanged. Attributes not defined here (``metainfo``, ``classes``, ...) are read from
    the wrapped dataset.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        with _caller_rngs_preserved():
            return self._load(key)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """Batch fetch (used by DataLoader): the RNG states are saved and restored once per batch,
        not per item, since saving and restoring numpy's state costs ~95 us, more than seeding all three
        RNGs (~9 us). In a DataLoader worker they are not restored at all: nothing but data loading
        draws from a worker's RNGs, and a collate function that does then draws from a stream the
        batch's last sample seeded, the same after a resume."""
        if not all(isinstance(k, SampleKey) for k in keys):  # plain keys: the global RNGs, as usual
            return [self[k] for k in keys]
        if get_worker_info() is not None:
            return [self._load(k) for k in keys]
        with _caller_rngs_preserved():
            return [self._load(k) for k in keys]

    def _load(self, key: SampleKey) -> Any:
        seed = key.seed
        # Only the CPU generator: torch.manual_seed would also reseed CUDA generators, which
        # fork_rng(devices=[]) does not restore (and it costs ~100x more).
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        # numpy's legacy seed takes 32-bit words; one word (the halves folded) costs 2 us, a list 12 us.
        np.random.seed((seed ^ (seed >> 32)) & 0xFFFFFFFF)
        return self.dataset[int(key)]

    def __getattr__(self, name: str) -> Any:
        # Guard: during unpickling in a worker ``dataset`` is not set yet; without this the lookup
        # below would recurse.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"SeededDataset({self.dataset!r})"


@contextlib.contextmanager
def _caller_rngs_preserved() -> Iterator[None]:
    """Restore torch's CPU generator, Python's ``random`` and numpy's global RNG on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
