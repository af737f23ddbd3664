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


def test_steps_that_differ_only_in_wording_run_once(tiny_config, tmp_path):
    """fp16 is measured as bf16, FSDP's defaults may be written out or not, a missing strategy is None, and a
    forward/backward run overrides accumulation: such configs run one fake step, so the recommended plan's
    verification reuses the configured plan's step when they are the same step."""
    from memfit.planner.runs import _canonical
    from memfit.planner.space import ModelFacts, Plan

    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    facts = ModelFacts((), (), (), False)
    configured = {**cfg, "strategy": dict(type="FSDPStrategy"),
                  "optim_wrapper": {**cfg["optim_wrapper"], "type": "AmpOptimWrapper", "dtype": "float16"}}
    bf16 = Plan("bf16", sharding="fsdp", micro_batch=1).apply(cfg, facts)
    assert _canonical(configured, True, 2) == _canonical(bf16, True, 2)
    assert _canonical(configured, False, 2) == _canonical({**bf16, "optim_wrapper": {
        **bf16["optim_wrapper"], "accumulative_counts": 4}}, False, 1)
    for other in (Plan("fp32", sharding="fsdp", micro_batch=1), Plan("bf16", sharding="zero2", micro_batch=1),
                  Plan("bf16", "blocks", "fsdp", micro_batch=1)):
        assert _canonical(configured, True, 2) != _canonical(other.apply(cfg, facts), True, 2), other.name
    offload = {**configured, "strategy": dict(type="FSDPStrategy", cpu_offload=True)}
    assert _canonical(offload, True, 2) == _canonical(configured, True, 2)  # a no-op on CPU tensors
    assert _canonical(configured, True, 2) != _canonical(configured, True, 1)
    # A config without a strategy key runs what strategy=None runs (a configured plan beside the reference).
    plain = {k: v for k, v in cfg.items() if k != "strategy"}
    assert _canonical(plain, True, 1) == _canonical({**plain, "strategy": None}, True, 1)
    assert _canonical(configured, True, 2) != _canonical(configured, False, 2)
