"""Optimizer offload in the plan space: each ``offload:optimizer`` row is composed from its sharding's step
(the optimizer's memory taken off the device) and equals the fake step that really offloads; CPU targets,
where host and device memory are one, are not offered it; the recommended plan trains with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.config import Config
from memfit.measure import CATEGORIES
from memfit.planner.devices import gpu, this_cpu
from memfit.planner.fake import build_meta_model, fake_process_group, measure_step
from memfit.planner.levers import fake_step_cfg
from memfit.planner.predict import on_target, predict
from memfit.planner.results import plan_result
from memfit.planner.space import ModelFacts, Plan, configured_plan


def _tracked(breakdown: dict) -> int:
    return sum(breakdown.get(c, 0) for c in CATEGORIES)


@pytest.fixture(scope="module")
def planned(tiny_config, tmp_path_factory):
    cfg = Config.fromfile(str(tiny_config(tmp_path_factory.mktemp("offload")))).to_dict()
    return cfg, predict(cfg, device=gpu("4090"), world_size=2, verify=False)


def test_offload_rows_equal_the_step_that_offloads(planned):
    cfg, pred = planned
    device = gpu("4090")
    rows = {r.plan: r for r in pred.results}
    offloaded = [r for r in pred.results if r.plan.offload == "optimizer"]
    assert {r.plan.sharding for r in offloaded} == {"none", "zero2", "fsdp"}  # not ZeRO-1: it builds its own
    meta = build_meta_model(cfg["model"])
    facts = ModelFacts.of(meta)
    # SGD with momentum keeps one fp32 buffer per parameter: the optimizer state a rank holds is a copy of its
    # parameters, all of them unsharded and at least half of them (shards padded) under ZeRO-2/FSDP at 2 ranks.
    momentum = 4 * sum(p.numel() for p in meta.parameters())
    for sharding in ("none", "zero2", "fsdp"):
        plan = Plan("fp32", "none", sharding, "optimizer", micro_batch=1, tf32=True)  # a 4090 has TF32
        composed = rows[plan]
        with fake_process_group(2):
            m = measure_step(fake_step_cfg(plan.apply(on_target(cfg, device), facts)), full=True, steps=1, cuda=True)
        measured = plan_result(plan, m, m, device, 2, 1, "measured")
        assert _tracked(composed.breakdown) == _tracked(measured.breakdown), sharding
        assert measured.breakdown["optimizer_state"] == 0 and m.host_peak > 0  # the state lives on the host
        # And it saves the device the optimizer's memory, for modelled time over the host link.
        # On the GPU the optimizer is fused, but not SGD over FSDP's shards (memfit.planner.levers.fused_on_shards).
        plain = rows[replace(plan, offload="none", fused_optimizer=sharding == "none")]
        saved = _tracked(plain.breakdown) - _tracked(composed.breakdown)
        floor = momentum if sharding == "none" else momentum / 2  # measured: exactly the state, 117136 / 62792 B
        assert floor <= saved <= plain.breakdown["optimizer_state"], (sharding, saved, floor)
        assert composed.seconds > plain.seconds


def test_a_configured_offload_is_read_and_written_back(planned, tmp_path):
    cfg, _ = planned
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    applied = Plan("bf16", "none", "fsdp", "optimizer", micro_batch=1).apply(cfg, facts)
    assert applied["cfg"]["optimizer_offload"] is True
    assert configured_plan(applied, facts).offload == "optimizer"
    assert "optimizer_offload" not in Plan("fp32", micro_batch=1).apply(applied, facts)["cfg"]


def test_cpu_targets_are_not_offered_optimizer_offload(planned):
    cfg, _ = planned
    pred = predict(cfg, device=this_cpu(), world_size=1, verify=False)
    assert not [r for r in pred.results if r.plan.offload == "optimizer"]
