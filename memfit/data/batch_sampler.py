"""Batch samplers a dataloader config may name (``batch_sampler=dict(type=...)``), resumable mid-epoch.

MMDetection's dataset configs batch with ``AspectRatioBatchSampler``: images whose width is less than their height
go in one group, the others in another, and a batch is the next ``batch_size`` images of one group in the
sampler's order; at the end of the epoch what is left in both groups is batched together. The batch
sampler holds images back (a group fills more slowly), so where training stopped is not a position in the
sampler's order; a resumed run replays the epoch's order from its start and skips the batches already trained
(``consumed // (batch_size * world_size)`` of them: every step trains one batch per rank). The replay reads
no image, only the sizes in the annotations. Written here because MMDetection's keeps its groups in the
iterator, which a DataLoader runs ahead of training, and cannot resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, DataLoader

from memfit.data.sampler import DefaultSampler, InfiniteSampler
from memfit.errors import ConfigError
from memfit.registry import DATA_SAMPLERS


def _portrait(dataset: Any) -> np.ndarray:
    """Per dataset index: width < height, from the dataset's annotations."""
    if hasattr(dataset, "image_hw"):
        hw = np.asarray(dataset.image_hw())
        return hw[:, 1] < hw[:, 0]
    if not hasattr(dataset, "get_data_info"):
        raise ConfigError("AspectRatioBatchSampler needs each image's width and height from the dataset "
                          f"(get_data_info(i)['width'/'height']), which {type(dataset).__name__} does not give")
    infos = (dataset.get_data_info(i) for i in range(len(dataset)))
    return np.array([info["width"] < info["height"] for info in infos], dtype=bool)


@DATA_SAMPLERS.register()
class AspectRatioBatchSampler(BatchSampler):
    """MMDetection's ``AspectRatioBatchSampler`` over a :class:`~memfit.data.DefaultSampler` (the same batches in
    the same order), which resumes mid-epoch (see the module's docstring)."""

    def __init__(self, sampler: DefaultSampler, batch_size: int, drop_last: bool = False, dataset: Any = None) -> None:
        if not isinstance(sampler, DefaultSampler) or isinstance(sampler, InfiniteSampler):
            raise ConfigError("AspectRatioBatchSampler batches an epoch's order, which only DefaultSampler has "
                              f"(got {type(sampler).__name__}): use sampler=dict(type='DefaultSampler') with train_cfg "
                              "by_epoch=True, or leave batch_sampler out")
        super().__init__(sampler, batch_size, drop_last)
        self.portrait = _portrait(dataset)

    def _epoch(self) -> Iterator[list]:
        groups: tuple[list, list] = ([], [])
        for sample in self.sampler.epoch_keys():
            group = groups[0 if self.portrait[int(sample)] else 1]
            group.append(sample)
            if len(group) == self.batch_size:
                yield group[:]
                group.clear()
        left = groups[0] + groups[1]
        for start in range(0, len(left), self.batch_size):
            batch = left[start:start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __iter__(self) -> Iterator[list]:
        trained = self.sampler.consumed // (self.batch_size * self.sampler.world_size)
        for i, batch in enumerate(self._epoch()):
            if i >= trained:
                yield batch

    def __len__(self) -> int:
        """The batches left in this epoch (all of them before it starts)."""
        left = len(self.sampler)
        return left // self.batch_size if self.drop_last else math.ceil(left / self.batch_size)


def build_batch_sampler(cfg: Any, sampler: Any, dataset: Any, batch_size: int, drop_last: Any, key: str) -> Any:
    """``batch_sampler`` of a dataloader config (a name or ``dict(type=...)`` of :data:`DATA_SAMPLERS`; MMEngine passes
    it the sampler and the loader's ``batch_size``, ``drop_last`` goes in it)."""
    if drop_last:
        raise ConfigError(f"{key}: drop_last with a batch_sampler: give it to the batch sampler "
                          f"({key}.batch_sampler.drop_last={drop_last!r}), as torch's DataLoader requires")
    cfg = {"type": cfg} if isinstance(cfg, str) else cfg
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ConfigError(f"{key}.batch_sampler: give dict(type='AspectRatioBatchSampler'), not "
                          f"{type(cfg).__name__}: a batch sampler object cannot resume mid-epoch")
    kind = cfg["type"]
    target = DATA_SAMPLERS.get(kind, f"{key}.batch_sampler") if isinstance(kind, str) else kind
    if not (isinstance(target, type) and issubclass(target, BatchSampler)):
        batchers = [n for n in DATA_SAMPLERS.names()
                    if isinstance(t := DATA_SAMPLERS.get(n), type) and issubclass(t, BatchSampler)]
        raise ConfigError(f"{key}.batch_sampler: {getattr(target, '__name__', kind)} is not a batch sampler (one of: "
                          f"{', '.join(batchers)}); a sampler goes in {key}.sampler")
    return DATA_SAMPLERS.build({**cfg, "type": target}, key=f"{key}.batch_sampler", sampler=sampler,
                               batch_size=batch_size, dataset=dataset)


def batch_size_of(loader: Any) -> int | None:
    """Samples per batch of ``loader`` (a torch DataLoader given a ``batch_sampler`` has ``batch_size=None``)."""
    if isinstance(loader, DataLoader) and loader.batch_size is None:
        return getattr(loader.batch_sampler, "batch_size", None)
    return getattr(loader, "batch_size", None)
