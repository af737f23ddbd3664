"""build_dataloader: an MMEngine-style dataloader config (or a live DataLoader) -> a resumable DataLoader.

The loader always samples through a memfit sampler (:class:`~memfit.data.sampler.DefaultSampler`
unless the config names another) with the run's seed, rank and world size, and reads items through
:class:`~memfit.data.seeded.SeededDataset`, so a run can be stopped and resumed at any iteration,
with any ``num_workers`` and at another world size, and see the same samples with the same
augmentation.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from memfit.data.batch_sampler import build_batch_sampler
from memfit.data.sampler import DefaultSampler
from memfit.data.seeded import SeededDataset
from memfit.errors import ConfigError, ConfigTypeError, component_error, did_you_mean, type_or_value_error
from memfit.registry import COLLATE_FNS, DATA_SAMPLERS, DATASETS, check_kwargs

# The keys of an MMEngine dataloader config that memfit reads; anything else is a typo.
DATALOADER_KEYS = (
    "batch_size",
    "dataset",
    "sampler",
    "batch_sampler",
    "collate_fn",
    "num_workers",
    "persistent_workers",
    "pin_memory",
    "drop_last",
    "prefetch_factor",
)
DEFAULT_SAMPLER = {"type": "DefaultSampler", "shuffle": True}


def build_dataloader(
    cfg: dict | DataLoader,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    key: str = "dataloader",
    device: torch.device | str | None = None,
) -> DataLoader:
    """Build a DataLoader from an MMEngine-style ``cfg`` dict, or adapt a live ``DataLoader``.

    ``cfg`` keys: ``batch_size`` and ``dataset`` (an object or ``dict(type=...)`` via DATASETS) are
    required; ``sampler`` (default ``dict(type='DefaultSampler', shuffle=True)``; a name or dict via
    DATA_SAMPLERS, or a sampler object), ``collate_fn`` (default ``default_collate``, or the dataset's
    ``default_collate_fn``; a name or dict via COLLATE_FNS, extra keys bound with ``functools.partial``, or a
    callable), ``num_workers``,
    ``persistent_workers``, ``pin_memory``, ``drop_last``, ``prefetch_factor``. With
    ``num_workers=0`` the two worker-only options are dropped (configs written for GPU machines
    then run unchanged). ``batch_sampler``: one of :mod:`memfit.data.batch_sampler`'s. ``seed``, ``rank`` and
    ``world_size`` go to the sampler; ``key`` names the config section in error messages. ``device``: where the
    batches go. On CUDA, batches are pinned unless ``pin_memory=False`` (pinning needs CUDA, so it is
    off elsewhere), and a missing ``num_workers`` is :func:`default_num_workers`.

    A live DataLoader whose sampler is a plain ``SequentialSampler``/``RandomSampler`` with automatic
    batching is rebuilt around a DefaultSampler (same dataset, batch size, collate function, workers,
    ``drop_last``, pinning; shuffled iff it was a RandomSampler), so it becomes resumable and
    rank-sharded. Any other live loader is returned unchanged; it can only resume by skipping batches.
    """
    if isinstance(cfg, DataLoader):
        return adapt_dataloader(cfg, seed=seed, rank=rank, world_size=world_size)
    if not isinstance(cfg, dict):
        raise ConfigTypeError(f"{key}: expected a dict or a torch DataLoader, got {type(cfg).__name__}")
    for k in cfg:
        if k not in DATALOADER_KEYS:
            raise ConfigError(f"{key}: unknown key {k!r}: {did_you_mean(k, DATALOADER_KEYS)}")
    for k in ("batch_size", "dataset"):
        if cfg.get(k) is None:
            raise ConfigError(f"{key}: missing {k!r}: set {key}.{k}")
    batch_size = cfg["batch_size"]
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise type_or_value_error(f"{key}: batch_size={batch_size!r} must be a positive int",
                                  not isinstance(batch_size, int) or isinstance(batch_size, bool))
    dataset = DATASETS.build(cfg["dataset"], key=f"{key}.dataset")
    sampler = build_sampler(cfg.get("sampler"), dataset, seed=seed, rank=rank, world_size=world_size, key=key)
    _check_not_empty(dataset, sampler, batch_size, bool(cfg.get("drop_last", False)), key)
    batching: dict[str, Any] = dict(batch_size=batch_size, sampler=sampler, drop_last=bool(cfg.get("drop_last", False)))
    if cfg.get("batch_sampler") is not None:
        batching = dict(batch_sampler=build_batch_sampler(cfg["batch_sampler"], sampler, dataset, batch_size,
                                                          cfg.get("drop_last"), key))
    collate_fn = _dataset_collate_fn(cfg.get("collate_fn"), dataset, key)
    if isinstance(sampler, DefaultSampler):
        dataset = SeededDataset(dataset)
    cuda = device is not None and torch.device(device).type == "cuda"
    try:  # DataLoader's own checks (num_workers, prefetch_factor, ...) as one line naming the key
        num_workers = cfg.get("num_workers")
        defaulted = num_workers is None
        num_workers = default_num_workers(device, world_size) if defaulted else int(num_workers)
        kwargs: dict[str, Any] = {}
        if num_workers > 0:
            # Workers memfit chose are kept across epochs (and validations): starting them costs seconds.
            kwargs["persistent_workers"] = bool(cfg.get("persistent_workers", defaulted))
            kwargs["prefetch_factor"] = cfg.get("prefetch_factor")
        pin = cfg.get("pin_memory")
        return DataLoader(
            dataset,
            **batching,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=cuda if pin is None else bool(pin) and cuda,
            **kwargs,
        )
    except (TypeError, ValueError) as exc:
        raise component_error(key, "DataLoader", exc) from exc


def default_num_workers(device: torch.device | str | None, world_size: int = 1) -> int:
    """Loader workers when the config gives none: on CUDA, this process's share of the CPU cores it may
    use (``os.sched_getaffinity``) less one for the training process itself, at most 8 (beyond that the
    GPU, not decoding, is the limit for vision models); elsewhere 0, since the step itself uses every core."""
    if device is None or torch.device(device).type != "cuda":
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, torch.cuda.device_count() or 1)))
    return max(0, min(8, cores // max(local, 1) - 1))


def close_workers(*loaders: Any) -> None:
    """Stop the persistent workers of ``loaders`` now. Left to the garbage collector (a Runner holds
    reference cycles), a loader's queues can be closed before its iterator, and each worker then waits
    out torch's 5 s timeout before it exits. The next iteration over a loader starts new workers."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None


def _check_not_empty(dataset: Any, sampler: Any, batch_size: int, drop_last: bool, key: str) -> None:
    """An empty dataset, or fewer samples on this rank than one batch with ``drop_last=True``, would
    give a loader with no batches: say so here, where the sizes are known, not at the first epoch."""
    try:
        n_dataset, n_rank = len(dataset), len(sampler)
    except TypeError:  # an iterable dataset or a sampler without a length
        return
    if n_dataset == 0:
        raise ConfigError(f"{key}.dataset is empty ({type(dataset).__name__} has 0 samples): "
                          f"check its root, split or num_samples")
    if drop_last and n_rank < batch_size:
        raise ConfigError(f"{key}: batch_size={batch_size} with drop_last=True leaves no batch "
                          f"({n_rank} samples on this rank): lower batch_size or set drop_last=False")


def build_sampler(
    cfg: dict | str | Any | None,
    dataset: Any,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    key: str = "dataloader",
) -> Any:
    """Build ``cfg`` (``None`` -> shuffled DefaultSampler; a name; ``dict(type=...)``; an object).

    The dataset, seed, rank and world size are passed to every argument of the sampler that takes
    them (``dataset``/``data_source``, ``seed``, ``num_replicas``, ``rank``), so torch's
    ``DistributedSampler`` given as a class also works. A ``seed: None`` in the config means the
    run's seed, as in MMEngine.
    """
    cfg = dict(DEFAULT_SAMPLER) if cfg is None else cfg
    if isinstance(cfg, str):
        cfg = {"type": cfg}
    if not isinstance(cfg, dict):
        return cfg
    cfg = dict(cfg)
    if "type" not in cfg:
        raise ConfigError(f"{key}.sampler: missing 'type': use e.g. dict(type='DefaultSampler')")
    if cfg.get("seed", 0) is None:
        del cfg["seed"]
    target = DATA_SAMPLERS.get(cfg["type"], f"{key}.sampler") if isinstance(cfg["type"], str) else cfg["type"]
    offered = {
        "dataset": dataset,
        "data_source": dataset,
        "seed": seed,
        "num_replicas": world_size,
        "rank": rank,
    }
    accepted = inspect.signature(target).parameters
    defaults = {k: v for k, v in offered.items() if k in accepted}
    return DATA_SAMPLERS.build({**cfg, "type": target}, key=f"{key}.sampler", **defaults)


def build_collate_fn(cfg: dict | str | Callable | None, *, key: str = "dataloader") -> Callable:
    """``None`` -> ``default_collate``; a name or ``dict(type=name, **kwargs)`` -> the registered
    function with ``kwargs`` bound; a callable -> itself."""
    if cfg is None:
        return default_collate
    if isinstance(cfg, str):
        cfg = {"type": cfg}
    if not isinstance(cfg, dict):
        if not callable(cfg):
            raise ConfigTypeError(f"{key}.collate_fn: expected a name, dict(type=...) or a callable, got {cfg!r}")
        return cfg
    cfg = dict(cfg)
    if "type" not in cfg:
        raise ConfigError(f"{key}.collate_fn: missing 'type': use e.g. dict(type='default_collate')")
    kind = cfg.pop("type")
    fn = COLLATE_FNS.get(kind, f"{key}.collate_fn") if isinstance(kind, str) else kind
    if cfg:
        check_kwargs(fn, cfg, f"{key}.collate_fn")
        fn = functools.partial(fn, **cfg)
    return fn


def _dataset_collate_fn(cfg: Any, dataset: Any, key: str) -> Callable:
    """The collate function ``cfg`` names, or the one ``dataset`` declares (``default_collate_fn``) when it names
    none; default_collate for such a dataset, whose samples it cannot stack, is refused before training."""
    preferred = getattr(dataset, "default_collate_fn", None)
    collate_fn = build_collate_fn(cfg if cfg is not None or preferred is None else preferred, key=key)
    if preferred is not None and collate_fn in (default_collate, COLLATE_FNS.get("default_collate")):
        raise ConfigError(f"{key}.collate_fn=default_collate cannot stack {type(dataset).__name__}'s samples "
                          f"(images of different sizes, boxes per image): use collate_fn=dict(type={preferred!r}), "
                          f"or leave collate_fn out (the default for this dataset, as in MMEngine)")
    return collate_fn


def adapt_dataloader(loader: DataLoader, *, seed: int, rank: int = 0, world_size: int = 1) -> DataLoader:
    """Rebuild a plain user DataLoader around a DefaultSampler; return any other loader unchanged.

    "Plain" means a map-style dataset, automatic batching (``batch_size`` set, no custom
    ``batch_sampler``) and a ``SequentialSampler`` or a without-replacement, full-length
    ``RandomSampler``: then swapping the sampler changes only the (now resumable, rank-sharded)
    order. A custom sampler or batch sampler encodes choices memfit cannot reproduce, so such a
    loader is kept as is and resumes by skipping batches.
    """
    sampler = loader.sampler
    plain_random = type(sampler) is RandomSampler and not sampler.replacement
    plain_random = plain_random and getattr(sampler, "_num_samples", None) is None  # full length
    plain = type(sampler) is SequentialSampler or plain_random
    auto_batched = loader.batch_size is not None and type(loader.batch_sampler) is BatchSampler
    if isinstance(loader.dataset, IterableDataset) or not (plain and auto_batched):
        return loader
    new_sampler = DefaultSampler(
        loader.dataset, shuffle=plain_random, seed=seed, num_replicas=world_size, rank=rank
    )
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:
        kwargs.update(
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            timeout=loader.timeout,
        )
    return DataLoader(
        SeededDataset(loader.dataset),
        batch_size=loader.batch_size,
        sampler=new_sampler,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        pin_memory_device=getattr(loader, "pin_memory_device", ""),
        **kwargs,
    )
