"""DumpResults (MMEngine's mmengine/evaluator/metric.py): ``runner.test()`` with it in ``test_evaluator``
writes a list with one entry per test sample, in dataset order, equal to the model's predictions."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit.evaluator.metric as metric_mod
from memfit.errors import ConfigError, ConfigTypeError
from memfit.evaluator import DumpResults, Evaluator
from memfit.model import BaseModel
from memfit.runner import Runner

N, BATCH = 10, 4  # the last batch holds 2 samples


class Classifier(BaseModel):
    def __init__(self, per_sample_dicts: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.per_sample_dicts = per_sample_dicts

    def forward(self, x, y, mode="tensor"):
        logits = self.fc(x)
        if mode == "loss":
            return {"loss": F.cross_entropy(logits, y)}
        if mode == "predict" and self.per_sample_dicts:  # mmpretrain's form: one dict per sample
            return [dict(pred_score=s, gt_label=t, meta=dict(index=int(t))) for s, t in zip(logits.softmax(-1), y)]
        return logits.softmax(-1), y


def _data() -> list:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g)
    return [(x[i], torch.tensor(i % 3)) for i in range(N)]


def _test(tmp_path, out_name: str, model: Classifier) -> list:
    out = tmp_path / out_name
    runner = Runner(model=model, work_dir=str(tmp_path / "work"),
                    test_dataloader=dict(batch_size=BATCH, dataset=_data(),
                                         sampler=dict(type="DefaultSampler", shuffle=False)),
                    test_evaluator=[dict(type="Accuracy"), dict(type="DumpResults", out_file_path=str(out))],
                    test_cfg=dict(), default_hooks=dict(logger=dict(interval=100)))
    metrics = runner.test()
    assert set(metrics) == {"accuracy/top1"}  # DumpResults adds no metric
    if out.suffix == ".pkl":
        with open(out, "rb") as f:
            return pickle.load(f)
    return torch.load(out, weights_only=True)  # the safe format: plain data only


@pytest.mark.parametrize("out_name", ["results.pkl", "results.pth"])
def test_runner_test_dumps_one_entry_per_sample_equal_to_the_predictions(tmp_path, out_name):
    results = _test(tmp_path, out_name, Classifier())
    reference = Classifier().eval()
    assert len(results) == N
    with torch.no_grad():
        for i, (x, y) in enumerate(_data()):
            scores, labels = reference(x[None], y[None], mode="predict")
            got_scores, got_label = results[i]
            torch.testing.assert_close(got_scores, scores[0])
            assert torch.equal(got_label, labels[0])
            # Each entry holds its own values, not a view of the whole batch.
            assert got_scores.untyped_storage().nbytes() == scores[0].numel() * scores.element_size()


def test_per_sample_dict_predictions_are_dumped_as_they_are(tmp_path):
    results = _test(tmp_path, "dicts.pkl", Classifier(per_sample_dicts=True))
    assert [r["meta"] for r in results] == [dict(index=i % 3) for i in range(N)]
    assert [int(r["gt_label"]) for r in results] == [i % 3 for i in range(N)]


def test_ranks_results_are_gathered_in_sample_order_without_padding(tmp_path, monkeypatch):
    # Two simulated ranks over 5 samples, batch 2: DefaultSampler gives rank 0 positions 0, 2, 4 and
    # rank 1 positions 1, 3, 5 (position 5 repeats sample 0 to even out the ranks).
    n, world = 5, 2
    parts = []
    for rank in range(world):
        monkeypatch.setattr(metric_mod, "get_world_size", lambda: world)
        monkeypatch.setattr(metric_mod, "get_rank", lambda rank=rank: rank)
        ev = Evaluator(dict(type="DumpResults", out_file_path=str(tmp_path / "r.pkl")), dataset_size=n)
        positions = list(range(rank, 6, world))
        for i in range(0, len(positions), 2):
            ids = torch.tensor([p % n for p in positions[i:i + 2]])
            ev.process(data_samples=(ids.float() * 10, ids), data_batch=(torch.zeros(len(ids), 1), ids))
        parts.append(ev.metrics[0].results)
    monkeypatch.setattr(metric_mod, "all_gather_object", lambda obj: parts)
    ev.evaluate(n)
    with open(tmp_path / "r.pkl", "rb") as f:
        results = pickle.load(f)
    assert [(float(s), int(i)) for s, i in results] == [(10.0 * i, i) for i in range(n)]


def test_bad_file_name_and_non_plain_predictions_are_one_line_errors():
    with pytest.raises(ConfigError, match="out_file_path='results.json'.*pkl"):
        DumpResults(out_file_path="results.json")
    with pytest.raises(ConfigTypeError, match=r"'\[0\]\.model' is a Linear"):
        DumpResults(out_file_path="r.pkl").process(None, [dict(model=nn.Linear(1, 1))])
