"""BaseMetric (MMEngine's contract) and the Evaluator that runs a list of them."""

from __future__ import annotations

from typing import Any

from memfit.dist import all_gather_object, get_world_size
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

    def process(self, data_batch: Any, data_samples: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def compute_metrics(self, results: list) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def evaluate(self, size: int | None = None) -> dict[str, Any]:
        """Gather results from all ranks (interleaved back into sample order, padding dropped)."""
        results = self.results
        if get_world_size() > 1:
            parts = all_gather_object(results)
            results = [r for part in parts for r in part]
        if size is not None:
            results = results[:size]
        metrics = self.compute_metrics(results)
        self.results = []
        if self.prefix:
            metrics = {f"{self.prefix}/{k}": v for k, v in metrics.items()}
        return metrics


class Evaluator:
    """Runs every metric over the batches of one validation or test epoch."""

    def __init__(self, metrics: BaseMetric | dict | list) -> None:
        items = metrics if isinstance(metrics, list) else [metrics]
        self.metrics = [METRICS.build(m, key="val_evaluator") for m in items]

    def process(self, data_samples: Any, data_batch: Any = None) -> None:
        for m in self.metrics:
            m.process(data_batch, data_samples)

    def evaluate(self, size: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in self.metrics:
            out.update(m.evaluate(size))
        return out
