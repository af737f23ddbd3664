"""Top-k accuracy for classifiers whose predict mode returns ``(scores, labels)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from memfit.errors import ConfigError
from memfit.evaluator.metric import BaseMetric
from memfit.registry import METRICS


@METRICS.register()
class Accuracy(BaseMetric):
    """Top-k accuracy in percent: ``dict(type='Accuracy', topk=(1, 5))`` -> ``accuracy/top1``, ``accuracy/top5``.

    Accepts predictions as ``(scores, labels)`` (the models in MMEngine's guides) or a list of dicts with
    ``pred_score``/``gt_label`` (mmpretrain's data samples).
    """

    default_prefix = "accuracy"

    def __init__(self, topk: int | Sequence[int] = (1,), collect_device: str = "cpu", prefix: str | None = None):
        super().__init__(collect_device, prefix)
        self.topk = (topk,) if isinstance(topk, int) else tuple(topk)
        if not self.topk or any(type(k) is not int or k < 1 for k in self.topk):
            raise ConfigError(f"topk={topk!r}: use a positive int or a tuple of them, e.g. topk=(1, 5)")

    def process(self, data_batch: Any, data_samples: Any) -> None:
        scores, labels = _scores_and_labels(data_samples)
        k = min(max(self.topk), scores.shape[-1])
        top = scores.topk(k, dim=-1).indices
        hits = top == labels.view(-1, 1)
        self.results.append(
            {"n": int(labels.numel()), **{f"top{t}": int(hits[:, : min(t, k)].any(-1).sum()) for t in self.topk}}
        )

    def result_names(self) -> list[str]:
        return [f"top{t}" for t in self.topk]

    def compute_metrics(self, results: list) -> dict[str, float]:
        n = sum(r["n"] for r in results)
        return {f"top{t}": 100.0 * sum(r[f"top{t}"] for r in results) / max(n, 1) for t in self.topk}


def _scores_and_labels(samples: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(samples, (tuple, list)) and len(samples) == 2 and isinstance(samples[0], torch.Tensor):
        scores, labels = samples
    elif isinstance(samples, Sequence) and samples and isinstance(samples[0], Mapping):
        scores = torch.stack([torch.as_tensor(s["pred_score"]) for s in samples])
        labels = torch.stack([torch.as_tensor(s["gt_label"]).view(-1)[0] for s in samples])
    else:
        raise TypeError("Accuracy expects predict outputs as (scores, labels) or dicts with pred_score/gt_label")
    return scores.detach().float().cpu(), torch.as_tensor(labels).detach().cpu().view(-1)
