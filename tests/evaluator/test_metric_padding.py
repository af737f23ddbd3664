"""The Evaluator drops the samples a distributed sampler repeats to even out the ranks, and gathers
per-sample results back into sample order (simulated ranks: no process group needed)."""

import torch

import memfit.evaluator.metric as metric_mod
from memfit.evaluator.accuracy import Accuracy
from memfit.evaluator.metric import BaseMetric, Evaluator


class Ids(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.extend(data_batch[1].tolist())

    def compute_metrics(self, results):
        return {"ids": results}


def test_padding_dropped_and_order_restored(monkeypatch):
    n, world, batch = 7, 2, 2
    per_rank = {}
    for rank in range(world):
        monkeypatch.setattr(metric_mod, "get_world_size", lambda: world)
        monkeypatch.setattr(metric_mod, "get_rank", lambda rank=rank: rank)
        ev = Evaluator([Ids(), Accuracy()], dataset_size=n)
        positions = list(range(rank, 8, world))  # DefaultSampler round_up: position 7 wraps to sample 0
        for i in range(0, len(positions), batch):
            ids = torch.tensor([p % n for p in positions[i:i + batch]])
            scores = torch.nn.functional.one_hot(ids % 3, 3).float()
            ev.process(data_samples=(scores, ids % 3), data_batch=(torch.zeros(len(ids), 1), ids))
        per_rank[rank] = [m.results for m in ev.metrics]
    # Rank 1's last sample (position 7, a repeat of sample 0) was not processed.
    assert per_rank[1][0] == [1, 3, 5] and per_rank[0][0] == [0, 2, 4, 6]
    assert sum(r["n"] for r in per_rank[1][1]) == 3

    parts = [per_rank[0][0], per_rank[1][0]]
    monkeypatch.setattr(metric_mod, "all_gather_object", lambda obj: parts)
    ids = Ids()
    ids.results = parts[0]
    assert ids.evaluate(n)["ids"] == list(range(7))
