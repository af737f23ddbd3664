"""``memfit bench``'s measurement of one plan (:func:`memfit.planner.bench.measure_plan`)."""

import pytest
import torch

from memfit.config import Config
from memfit.planner.bench import measure_plan
from memfit.planner.fake import build_meta_model
from memfit.planner.space import ModelFacts, configured_plan


def test_fp16_warm_up_runs_until_the_scaler_stops_skipping(tiny_config, tmp_path):
    """fp16 at a loss scale where every gradient overflows: the GradScaler skips the first optimizer
    steps, so one warm-up step leaves no optimizer state and the measured step would miss it (DINO on
    an H100 did). The warm-up steps until the state exists; the measured step holds it."""
    cfg = Config.fromfile(tiny_config(tmp_path)).to_dict()
    cfg["optim_wrapper"] = {**cfg["optim_wrapper"], "type": "AmpOptimWrapper", "dtype": "float16",
                            "loss_scale": {"init_scale": 2.0**20}}  # halved per skipped step
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    m = measure_plan(cfg, configured_plan(cfg, facts, cuda=False), facts, steps=1)
    n = sum(p.numel() for p in build_meta_model(cfg["model"]).parameters())
    assert m.breakdown["optimizer_state"] == pytest.approx(4 * n, rel=0.01)  # SGD's fp32 momentum buffers
    assert torch.isfinite(torch.tensor(m.seconds))


def test_an_optimizer_offload_plan_is_measured_offloaded(tiny_config, tmp_path):
    """bench and the GPU calibration set a plan up as the runner does: its optimizer offload too (the state on the
    host), not only its model techniques."""
    from memfit.optim.offload import OffloadedOptimizer
    from memfit.planner.bench import build_for_training
    from memfit.planner.commands import parse_plan

    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    plan = parse_plan("fp32 offload:optimizer", configured_plan(cfg, facts, cuda=False))
    _, wrapper, _ = build_for_training(plan.apply(cfg, facts))
    assert isinstance(wrapper.optimizer, OffloadedOptimizer)
