"""BaseMetric (MMEngine's contract) and the Evaluator that runs a list of them."""

from __future__ import annotations

from typing import Any

from memfit.dist import all_gather_object, get_rank, get_world_size
from memfit.registry import METRICS


class BaseMetric:
    """Accumulate per-batch results in ``self.results`` with ``process``; reduce them in ``compute_metrics``.

    Results are gathered from every rank before ``compute_metrics`` runs (on every rank), so a
    metric is written exactly as for one process.
    """

    default_prefix: str | None = None

    def __init__(self, collect_device: str = "cpu", prefix: str | None = None) -> None:
        self.collect_device = collect_device
        self.prefix = prefix or self.default_prefix
        self.results: list[Any] = []
        # The evaluated dataset's ``metainfo`` (e.g. ``{'classes': (...)}``), set by the Evaluator
        # before evaluation as MMEngine's loops do; None when the dataset has none.
        self.dataset_meta: dict | None = None

    def process(self, data_batch: Any, data_samples: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def compute_metrics(self, results: list) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def result_names(self) -> list[str] | None:
        """The names ``compute_metrics`` returns, where the configuration alone says (None: unknown before
        evaluating): a checkpoint's ``save_best`` is checked against them before training."""
        return None

    def metric_names(self) -> list[str] | None:
        """:meth:`result_names` as :meth:`evaluate` returns them (with the prefix), or None."""
        names = self.result_names()
        return None if names is None else [f"{self.prefix}/{n}" if self.prefix else n for n in names]

    def evaluate(self, size: int | None = None) -> dict[str, Any]:
        """Gather results from all ranks, interleaved back into sample order.

        The samplers deal global position ``p`` to rank ``p % world_size``, so the i-th result of
        every rank, rank by rank, restores the order when results are per sample. The padding that
        evens out the ranks' shares is removed before ``process`` (see :class:`Evaluator`), so a
        metric that appends one entry per batch does not count the duplicated samples either.
        """
        results = self.results
        if get_world_size() > 1:
            parts = all_gather_object(results)
            results = [part[i] for i in range(max(map(len, parts), default=0)) for part in parts if i < len(part)]
        if size is not None:
            results = results[:size]
        metrics = self.compute_metrics(results)
        self.results = []
        if self.prefix:
            metrics = {f"{self.prefix}/{k}": v for k, v in metrics.items()}
        return metrics


class Evaluator:
    """Runs every metric over the batches of one validation or test epoch."""

    def __init__(self, metrics: BaseMetric | dict | list, dataset_size: int | None = None,
                 key: str = "val_evaluator") -> None:
        items = metrics if isinstance(metrics, list) else [metrics]
        # ``key`` (val_evaluator / test_evaluator) names the config entry in errors: key[i] for a list.
        self.metrics = [METRICS.build(m, key=f"{key}[{i}]" if isinstance(metrics, list) else key)
                        for i, m in enumerate(items)]
        # With it, the samples a distributed sampler repeats to give every rank the same number of
        # batches (global positions >= dataset_size) are dropped before the metrics see them.
        self.dataset_size = dataset_size
        self._seen = 0  # samples this rank has processed in the current evaluation

    @property
    def dataset_meta(self) -> dict | None:
        return self.metrics[0].dataset_meta if self.metrics else None

    @dataset_meta.setter
    def dataset_meta(self, meta: dict | None) -> None:
        """Give every metric the dataset's ``metainfo`` (class names for COCO's category ids)."""
        for m in self.metrics:
            m.dataset_meta = meta

    def metric_names(self) -> list[str] | None:
        """Every metric's names (:meth:`BaseMetric.metric_names`), or None where one of them cannot say."""
        names: list[str] = []
        for m in self.metrics:
            known = m.metric_names() if hasattr(m, "metric_names") else None
            if known is None:
                return None
            names += known
        return names

    def process(self, data_samples: Any, data_batch: Any = None) -> None:
        world = get_world_size()
        if self.dataset_size is not None and world > 1:
            n = batch_len(data_batch, data_samples)
            if n is not None:
                rank, first = get_rank(), self._seen
                self._seen += n
                # This rank's k-th sample has global position rank + k * world (DefaultSampler and
                # torch's DistributedSampler both deal positions round-robin).
                real = sum(1 for k in range(first, first + n) if rank + k * world < self.dataset_size)
                if real == 0:
                    return
                if real < n:
                    data_samples, data_batch = (take_samples(data_samples, n, slice(real)),
                                                 take_samples(data_batch, n, slice(real)))
        for m in self.metrics:
            m.process(data_batch, data_samples)

    def evaluate(self, size: int | None = None) -> dict[str, Any]:
        self._seen = 0
        out: dict[str, Any] = {}
        for m in self.metrics:
            out.update(m.evaluate(size))
        return out


def batch_len(data_batch: Any, data_samples: Any) -> int | None:
    """The number of samples in a batch: the leading size of its first tensor (else of the outputs)."""
    import torch
    from torch.utils._pytree import tree_leaves

    for obj in (data_batch, data_samples):
        for leaf in tree_leaves(obj):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return int(leaf.shape[0])
        if isinstance(obj, list | tuple) and obj and not isinstance(obj[0], torch.Tensor):
            return len(obj)
    return None


def take_samples(obj: Any, n: int, index: int | slice) -> Any:
    """Sample ``index`` (an int) or samples ``index`` (a slice) of a batch-like structure of ``n`` samples.

    Tensors with leading size ``n`` are indexed; a list/tuple of ``n`` per-sample items (data samples,
    per-image dicts) is indexed, unless its items are themselves batch tensors (``(scores, labels)``),
    which are indexed one by one; dicts are handled per value; anything else is kept.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return obj[index] if obj.dim() > 0 and obj.shape[0] == n else obj
    if isinstance(obj, dict):
        return type(obj)({key: take_samples(v, n, index) for key, v in obj.items()})
    if isinstance(obj, list | tuple):
        batched = all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n for v in obj)
        if len(obj) == n and not batched:
            return obj[index]
        items = [take_samples(v, n, index) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
