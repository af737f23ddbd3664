"""Step-time calibration (memfit.planner.calibration, memfit.planner.time_profile): a quick calibration on the
CPU makes a valid profile, a target finds its own profile or the nearest (else the constants), the cost model
scales each term by the profile's factor and equals the constants' formula without one, and ``memfit bench
--calibrate`` refuses a machine without CUDA in one line and writes a profile with ``--device cpu``."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from memfit.cli import main
from memfit.errors import ConfigError
from memfit.planner import time_profile
from memfit.planner.calibration import calibrate
from memfit.planner.cost import (
    HOST_OP_FACTOR,
    MODEL_MEMORY_BOUND,
    ModelState,
    micro_step_seconds,
    optimizer_seconds,
    step_time,
)
from memfit.planner.devices import gpu
from memfit.planner.fake import Phase, StepMeasurement
from memfit.planner.space import Plan
from memfit.planner.time_profile import DEFAULT, Profile, describe, load, profile_for


@pytest.fixture(scope="module")
def cpu_profile() -> dict:
    return calibrate("cpu", quick=True)


def _profile(name: str, family: str, gpu_name: str = "", **factors) -> Profile:
    return Profile(name, gpu_name, family, factors, {"peak_tflops": dict(gpu(name).tflops)})


H100 = _profile("H100", "hopper", "NVIDIA H100 80GB HBM3", matmul={"bf16": 0.6})
RTX4090 = _profile("4090", "ada", "NVIDIA GeForce RTX 4090")


def test_quick_cpu_calibration_makes_a_valid_profile(cpu_profile):
    data = json.loads(json.dumps(cpu_profile))  # JSON as written
    profile = Profile.from_json(data)
    assert (profile.name, profile.family, data["quick"]) == ("cpu", "cpu", True)
    assert {"torch", "date", "gpu", "peak_tflops", "measured"} <= set(data)
    f = profile.factors
    for kind in ("matmul", "conv", "conv_channels_last"):
        assert set(f[kind]) == {"fp32", "bf16"} and all(v > 0 and math.isfinite(v) for v in f[kind].values()), kind
    for key in ("memory_bound", "launch_us", "optimizer_foreach_passes", "optimizer_fused_passes", "host_step_gbps"):
        assert profile.number(key, -1.0) > 0, key
    assert f["optimizer_foreach_op_us"] >= 0 and f["link_bw"] is None
    assert "host_bw" not in f  # no host<->device copies on a CPU
    assert data["measured"]["optimizer"]["foreach_ops"] > data["measured"]["optimizer"]["fused_ops"]
    # a small ViT's forward and backward: its host cost per operator counted, over a bare operator's
    host = data["measured"]["model_host"]
    assert host["ops"] > 100 and f["host_op_factor"] == host["factor"] == pytest.approx(
        host["op_us"] / f["launch_us"], rel=0.01)


def test_profile_lookup_own_nearest_or_constants():
    both = (H100, RTX4090)
    assert profile_for(gpu("H100"), both) == (H100, True)
    assert profile_for(replace(gpu("H100"), name="NVIDIA H100 80GB HBM3"), both) == (H100, True)  # current_cuda's
    assert profile_for(gpu("H200"), both) == (H100, False)  # same family
    assert profile_for(gpu("L40S"), both) == (RTX4090, False)
    assert profile_for(gpu("A100-80"), both) == (RTX4090, False)  # ampere (8.0): ada (8.9) before hopper (9.0)
    assert profile_for(gpu("A100-80"), (H100,)) == (H100, False)
    assert profile_for(gpu("H100"), ()) == (DEFAULT, False)
    assert profile_for(replace(gpu("H100"), cuda=False, family="cpu"), both) == (DEFAULT, False)
    assert describe(gpu("H100"), both) is None and describe(gpu("H100"), ()) is None
    assert describe(gpu("A100-80"), (H100,)).startswith("time model: H100 profile (nearest to A100-80")


def test_profile_files_load_and_bad_ones_are_named(tmp_path, cpu_profile):
    assert all(isinstance(p, Profile) for p in time_profile.installed())  # the package's, if any, are valid
    (tmp_path / "cpu.json").write_text(json.dumps(cpu_profile))
    assert [p.name for p in time_profile.installed(tmp_path)] == ["cpu"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1, "name": "X"}))
    with pytest.raises(ConfigError, match="bad.json"):
        load(bad)


MICRO = StepMeasurement(peak=0, breakdown={}, forward_backward=Phase(), optimizer=Phase(), flops=8 * 10**12,
                        conv_flops=3 * 10**12, written=5 * 10**9, ops=3000, step_ops=40)
STATE = ModelState(params=4 * 10**8, grads=4 * 10**8, optimizer=8 * 10**8)


PLANS = [Plan(), Plan(tf32=True), Plan(precision="bf16"), Plan(precision="bf16", channels_last=True),
         Plan(precision="fp16", fused_optimizer=True)]


def _constants_parts(plan: Plan, device) -> tuple[float, float]:
    """The formula without a profile, written out: the kernels' seconds (efficiency 0.5, 2 x written at the table's
    bandwidth x MODEL_MEMORY_BOUND, LEVER_FACTORS) and the host's (20 us per operator x HOST_OP_FACTOR)."""
    tf32, fp32 = device.tflops.get("tf32"), device.tflops["fp32"]
    conv_rate = tf32 if plan.precision == "fp32" else device.tflops[plan.precision]
    rate = (tf32 * 0.70 if plan.tf32 else fp32) if plan.precision == "fp32" else device.tflops[plan.precision]
    conv = MICRO.conv_flops / (conv_rate * 1e12 * 0.5) * (0.8 if plan.channels_last else 1.0)
    other = (MICRO.flops - MICRO.conv_flops) / (rate * 1e12 * 0.5)
    written = 2 * MICRO.written / (device.mem_bw * 1e9 * MODEL_MEMORY_BOUND)
    return conv + other + written, MICRO.ops * 20e-6 * HOST_OP_FACTOR


@pytest.mark.parametrize("plan", PLANS, ids=[p.name for p in PLANS])
def test_without_a_profile_the_constants_apply(plan, monkeypatch):
    monkeypatch.setattr(time_profile, "installed", lambda: ())
    device = gpu("A100-80")
    kernels, host = _constants_parts(plan, device)
    assert micro_step_seconds(plan, MICRO, device) == pytest.approx(max(kernels, host), rel=1e-12)
    assert micro_step_seconds(plan, MICRO, device) == micro_step_seconds(plan, MICRO, device, DEFAULT)
    passes = 1.0 if plan.fused_optimizer else 20 / 7
    one_pass = (2 * STATE.params + STATE.grads + 2 * STATE.optimizer) / (device.mem_bw * 1e9)
    assert optimizer_seconds(plan, STATE, device, 40) == pytest.approx(one_pass * passes + 40 * 20e-6, rel=1e-12)
    # The host runs ahead of the kernels it launches: the step is the slower of the two, optimizer step included.
    assert step_time(plan, MICRO, MICRO, STATE, device, 1, 1).seconds == pytest.approx(
        max(kernels + one_pass * passes, host + MICRO.step_ops * 20e-6), rel=1e-12)


def test_profile_factors_scale_their_terms(monkeypatch, constants_time_model):
    device = gpu("H100")
    bf16 = Plan(precision="bf16")
    only = {"matmul": StepMeasurement(0, {}, Phase(), Phase(), flops=10**13),
            "conv": StepMeasurement(0, {}, Phase(), Phase(), flops=10**13, conv_flops=10**13),
            "written": StepMeasurement(0, {}, Phase(), Phase(), written=10**10),
            "ops": StepMeasurement(0, {}, Phase(), Phase(), ops=1000)}

    def seconds(term: str, plan: Plan = bf16, **factors) -> float:
        return micro_step_seconds(plan, only[term], device, Profile("H100", "", "hopper", factors))

    assert seconds("matmul", matmul={"bf16": 1.0}) == pytest.approx(seconds("matmul") / 2)  # 0.5 -> 1.0: half
    assert seconds("matmul", matmul={"fp32": 1.0}) == seconds("matmul")  # another dtype's factor
    assert seconds("matmul", Plan(tf32=True), matmul={"tf32": 0.35}) == pytest.approx(
        seconds("matmul", Plan(tf32=True)))  # the measured TF32 efficiency in place of 0.5 x the lever's 0.70
    assert seconds("conv", conv={"bf16": 0.25}) == pytest.approx(2 * seconds("conv"))
    cl = replace(bf16, channels_last=True)
    assert seconds("conv", cl, conv={"bf16": 0.25}, conv_channels_last={"bf16": 1.0}) == pytest.approx(
        seconds("conv") / 2)  # measured channels_last: no lever factor on top
    assert seconds("conv", cl, conv={"bf16": 0.25}) == pytest.approx(2 * seconds("conv") * 0.8)
    assert seconds("written", memory_bound=0.5) == pytest.approx(2 * seconds("written"))
    assert seconds("ops", launch_us=5.0) == pytest.approx(seconds("ops") / 4)
    profile = Profile("H100", "", "hopper", {"optimizer_foreach_passes": 4.0, "optimizer_foreach_op_us": 0.0,
                                             "optimizer_fused_passes": 2.0, "optimizer_fused_tensor_us": 0.0})
    one_pass = (2 * STATE.params + STATE.grads + 2 * STATE.optimizer) / (device.mem_bw * 1e9)
    assert optimizer_seconds(Plan(), STATE, device, 40, profile) == pytest.approx(4 * one_pass)
    assert optimizer_seconds(Plan(fused_optimizer=True), STATE, device, 40, profile) == pytest.approx(2 * one_pass)
    # A fused step's fixed cost is per tensor it steps, whatever its few launches.
    per_tensor = Profile("H100", "", "hopper", {"optimizer_fused_passes": 2.0, "optimizer_fused_tensor_us": 5.0})
    assert optimizer_seconds(Plan(fused_optimizer=True), replace(STATE, tensors=100), device, 40, per_tensor) == \
        pytest.approx(2 * one_pass + 100 * 5e-6)
    # An installed profile times its GPU's plans and the nearest's, not a CPU's.
    before = step_time(bf16, MICRO, MICRO, STATE, gpu("H200"), 1, 1).seconds
    monkeypatch.setattr(time_profile, "installed", lambda: (Profile("H100", "", "hopper", {"launch_us": 10.0}),))
    # (MICRO's step is paced by its host: each operator x HOST_OP_FACTOR, the optimizer's each once)
    assert step_time(bf16, MICRO, MICRO, STATE, gpu("H200"), 1, 1).seconds == pytest.approx(
        before - (MICRO.ops * HOST_OP_FACTOR + MICRO.step_ops) * 10e-6)


def test_calibrate_without_cuda_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--calibrate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("memfit: error: --calibrate: no CUDA GPU here"), err
    assert main(["bench"]) == 2
    assert "bench needs a CONFIG" in capsys.readouterr().err


def test_calibrate_on_cpu_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "sub" / "cpu.json"
    assert main(["bench", "--calibrate", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| matmul fp32 |" in printed and f"wrote {out}" in printed
    assert load(out).name == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA GPU")
def test_gpu_calibration_quick():
    data = calibrate("cuda", quick=True)
    profile = Profile.from_json(data)
    assert gpu(profile.name).family == profile.family  # the table's entry for this GPU
    assert set(profile.factors["matmul"]) >= {"fp32", "bf16", "fp16"}
    assert profile.factors["host_bw"] > 0 and profile.factors["launch_us"] > 0
    assert all(v > 0 for v in profile.factors["attention"].values())
