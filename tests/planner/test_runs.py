"""Fake steps in forked workers, and the fall-back to this process once forking cannot run backward."""

import pytest

from memfit.config import Config
from memfit.planner.devices import gpu
from memfit.planner.predict import predict


def test_predictions_in_workers_match_in_process_and_survive_a_second_call(tiny_config, tmp_path, monkeypatch):
    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "1")
    serial = predict(cfg, device=gpu("H100"), verify=False)
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "2")
    # This process has run fake backward passes by now: forked workers cannot, and the runs fall back here.
    again = predict(cfg, device=gpu("H100"), verify=False)
    assert [(r.plan, r.peak_bytes) for r in again.results] == [(r.plan, r.peak_bytes) for r in serial.results]
    assert len(serial.results) > 1


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_worker_count_is_at_least_one(workers, monkeypatch):
    from memfit.planner.runs import workers as count

    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", workers)
    assert count() == 1
