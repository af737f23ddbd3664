"""The speed levers as plan axes (memfit.planner.levers): a plan's name and config carry them both ways, every
enumerated plan gets the levers its target and model allow (and only those), the time model prices each,
compiled twins are listed only when asked for and report their eager plan's memory, and the fake step runs
a config that sets TF32, cuDNN's benchmark and compile for a GPU without one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from memfit.model import BaseModel
from memfit.planner.autofit import auto_fit_options
from memfit.planner.commands import parse_plan
from memfit.planner.cost import ModelState, lever_factor, micro_step_seconds, optimizer_seconds
from memfit.planner.devices import gpu, this_cpu
from memfit.planner.fake import Phase, StepMeasurement, build_meta_model, fake_process_group, measure_step
from memfit.planner.levers import BENCHMARK_OFF, EAGER_MEMORY, allowed_levers, fake_step_cfg
from memfit.planner.predict import on_target, predict
from memfit.planner.results import plan_result
from memfit.planner.space import LEVER_WORDS, ModelFacts, Plan, configured_plan, enumerate_plans

LEVERS = tuple(LEVER_WORDS)  # the plan's fields
LOADER = dict(batch_size=2, num_workers=0, dataset=dict(type="ShapesDataset", image_size=16, num_classes=2,
                                                        num_samples=4))


class _ConvBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.act = nn.Conv2d(c, c, 3, padding=1), nn.ReLU()

    def forward(self, x):
        return x + self.act(self.conv(x))


class _ConvNet(BaseModel):
    """Two repeated 3x3 convolution blocks after a stem, and a linear head: a model channels_last and cuDNN's
    benchmark speed up."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(_ConvBlock(8), _ConvBlock(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x=None, mode="tensor", img=None, **_):
        out = self.head(self.blocks(self.stem((x if x is not None else img).float())).mean((2, 3)))
        return {"loss": out.square().mean()} if mode == "loss" else out


def _conv_cfg(**over) -> dict:
    with torch.device("meta"):
        model = _ConvNet()
    return {"model": model, "train_dataloader": LOADER,
            "optim_wrapper": dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)), **over}


VIT = dict(type="TimmClassifier", model_name="vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8,
           embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.0)


@pytest.fixture(scope="module")
def conv_facts() -> ModelFacts:
    return ModelFacts.of(build_meta_model(_conv_cfg()["model"]))


@pytest.fixture(scope="module")
def on_h100():
    """The conv net's plans on an H100, compiled twins asked for."""
    return predict(_conv_cfg(), device=gpu("H100"), compile=True)


def test_plan_names_carry_the_levers_both_ways():
    base = Plan("bf16", micro_batch=4)
    plans = [Plan("fp32", "blocks", "fsdp", "optimizer", True, 2, 2, *(True,) * 5),
             Plan("fp32", tf32=True, micro_batch=2),
             Plan("bf16", sharding="zero1", fused_optimizer=True, micro_batch=2),
             Plan("fp16", compile=True, channels_last=True, cudnn_benchmark=True, micro_batch=1)]
    assert plans[0].name == ("fp32 ac:blocks fsdp offload:optimizer conv-bn compile channels_last fused tf32 "
                             "cudnn_benchmark mb2x2")
    for p in plans:
        assert parse_plan(p.name, base) == p, p.name
    assert parse_plan("fp32 mb2x1", replace(base, compile=True, tf32=True)) == Plan("fp32", micro_batch=2)


def test_apply_writes_each_lever_and_configured_plan_reads_it_back(conv_facts):
    cfg = _conv_cfg(env_cfg=dict(dist_cfg=dict(backend="gloo")), compile=dict(mode="max-autotune"),
                    cfg=dict(channels_last=True, tf32=True))
    off = Plan("fp32", micro_batch=2).apply(cfg, conv_facts)  # a plan without levers is exactly that
    assert "compile" not in off and "channels_last" not in off["cfg"] and "tf32" not in off["cfg"]
    assert off["env_cfg"] == dict(dist_cfg=dict(backend="gloo"))
    assert off["optim_wrapper"]["optimizer"] == dict(type="AdamW", lr=1e-3)
    assert configured_plan(off, conv_facts) == Plan("fp32", micro_batch=2)
    for lever in LEVERS:
        plan = replace(Plan("fp32", micro_batch=2), **{lever: True})
        applied = plan.apply(off, conv_facts)
        assert configured_plan(applied, conv_facts) == plan, lever
        again = replace(plan, **{lever: False}).apply(applied, conv_facts)  # and off again
        assert {**again, "model": None} == {**off, "model": None}, lever
    cfg["optim_wrapper"]["optimizer"]["foreach"] = True
    on = replace(Plan("fp32", micro_batch=2), **dict.fromkeys(LEVERS, True)).apply(cfg, conv_facts)
    assert on["compile"] == dict(mode="max-autotune")  # the config's own compile options kept
    whole = replace(Plan("fp32", micro_batch=2), compile=True).apply(off, conv_facts)
    assert whole["compile"] == dict(regional=False)  # else the whole model in one graph (measured faster)
    assert on["cfg"]["channels_last"] is True and on["cfg"]["tf32"] is True
    assert on["env_cfg"] == dict(dist_cfg=dict(backend="gloo"), cudnn_benchmark=True)
    assert on["optim_wrapper"]["optimizer"] == dict(type="AdamW", lr=1e-3, fused=True)  # foreach removed
    # A config that sets levers keeps them in its configured plan (top-level technique keys too).
    own = configured_plan({**_conv_cfg(), "channels_last": True, "tf32": True}, conv_facts)
    assert own.channels_last and own.tf32 and own.configured


def test_the_fake_step_runs_without_the_process_wide_switches():
    cfg = _conv_cfg(compile=True, tf32=True, cfg=dict(tf32=True, channels_last=True),
                    env_cfg=dict(cudnn_benchmark=True, mp_cfg=dict()))
    cfg["optim_wrapper"]["optimizer"]["fused"] = True
    out = fake_step_cfg(cfg)
    assert "compile" not in out and "tf32" not in out and out["cfg"] == dict(channels_last=True)
    assert out["env_cfg"] == dict(mp_cfg=dict()) and out["optim_wrapper"]["optimizer"]["fused"] is True
    assert cfg["cfg"]["tf32"] and cfg["env_cfg"]["cudnn_benchmark"]  # the caller's config untouched


def test_levers_follow_the_target_and_the_model(conv_facts):
    cfg = _conv_cfg()
    # cuDNN's benchmark only when the config asks for it: its workspaces' memory is not predicted.
    assert dict(allowed_levers(cfg, conv_facts, gpu("H100"), fixed_size=True).off) == {
        "compile": "its memory is not predicted: ask with --compile", "cudnn_benchmark": BENCHMARK_OFF}
    cfg = {**cfg, "env_cfg": dict(cudnn_benchmark=True)}
    h100 = allowed_levers(cfg, conv_facts, gpu("H100"), fixed_size=True)
    assert (h100.channels_last, h100.fused_optimizer, h100.tf32, h100.cudnn_benchmark, h100.compile) == \
        (True, True, True, True, False)
    assert dict(h100.off) == {"compile": "its memory is not predicted: ask with --compile"}
    cpu = allowed_levers(cfg, conv_facts, this_cpu(0.001), fixed_size=True)
    assert not any(getattr(cpu, k) for k in LEVERS)
    assert not allowed_levers(cfg, conv_facts, gpu("H100"), fixed_size=False).cudnn_benchmark  # sizes vary
    assert not allowed_levers(cfg, conv_facts, gpu("T4"), fixed_size=True).tf32  # Turing: no TF32
    assert "tf32" not in gpu("T4").tflops and gpu("A100-80").tflops["tf32"] == 156
    class Plain(torch.optim.SGD):  # no fused= argument
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)

    plain = {**cfg, "optim_wrapper": dict(optimizer=dict(type=Plain, lr=0.1))}
    assert not allowed_levers(plain, conv_facts, gpu("H100"), fixed_size=True).fused_optimizer
    vit = ModelFacts.of(build_meta_model(VIT))  # its one convolution patchifies: not a conv model
    assert not vit.convs and conv_facts.convs
    vit_levers = allowed_levers(cfg, vit, gpu("H100"), fixed_size=True)
    assert not vit_levers.channels_last and not vit_levers.cudnn_benchmark and vit_levers.tf32

    plans = [h100.on(p) for p in enumerate_plans(Plan("fp32", micro_batch=2), conv_facts, 2)]
    for p in plans:
        fsdp = p.sharding in ("zero2", "fsdp") or p.offload == "params"
        assert p.tf32 == (p.precision == "fp32") and p.cudnn_benchmark and not p.compile, p.name
        assert p.channels_last == (not fsdp), p.name  # fully_shard refuses channels_last parameters
        assert p.fused_optimizer == (p.offload == "none"), p.name  # an offloaded optimizer steps on the host
    assert {p.precision for p in plans} == {"fp32", "bf16", "fp16"}
    # DTensor has no sharding rule for fused SGD: FSDP plans step it with foreach.
    sgd = allowed_levers({**cfg, "optim_wrapper": dict(optimizer=dict(type="SGD", lr=0.1))}, conv_facts, gpu("H100"),
                         fixed_size=True)
    for p in (sgd.on(p) for p in enumerate_plans(Plan("fp32", micro_batch=2), conv_facts, 2)):
        assert p.fused_optimizer == (p.offload == "none" and p.sharding in ("none", "zero1")), p.name
    assert all(not any(getattr(p, k) for k in LEVERS)
               for p in enumerate_plans(Plan("fp32", micro_batch=2), conv_facts, 1))  # none unless given


def test_tf32_and_the_conv_levers_in_the_time_model(constants_time_model):
    h100, t4 = gpu("H100"), gpu("T4")
    matmul = StepMeasurement(0, {}, Phase(), Phase(), flops=10**12)
    conv = replace(matmul, conv_flops=10**12)
    fp32 = Plan("fp32")
    eff = h100.efficiency
    assert micro_step_seconds(fp32, matmul, h100) == pytest.approx(1 / (67 * eff))
    tf32_rate = 495 * lever_factor(h100, "tf32_matmul_rate")  # the data sheet's, as fitted on an H100
    assert micro_step_seconds(replace(fp32, tf32=True), matmul, h100) == pytest.approx(1 / (tf32_rate * eff))
    assert micro_step_seconds(replace(fp32, tf32=True), matmul, t4) == pytest.approx(1 / (8.1 * t4.efficiency))
    # cuDNN runs fp32 convolutions in TF32 unless told not to; channels_last and the benchmark scale them.
    assert micro_step_seconds(fp32, conv, h100) == pytest.approx(1 / (495 * eff))
    fast = replace(fp32, channels_last=True, cudnn_benchmark=True)
    assert micro_step_seconds(fast, conv, h100) == pytest.approx(
        lever_factor(h100, "channels_last") * lever_factor(h100, "cudnn_benchmark") / (495 * eff))
    cpu = this_cpu(0.001)
    assert micro_step_seconds(fast, conv, cpu) == micro_step_seconds(fp32, conv, cpu)  # CUDA's levers only
    state = ModelState(params=4 << 20, grads=4 << 20, optimizer=8 << 20)
    assert optimizer_seconds(replace(fp32, fused_optimizer=True), state, h100) < optimizer_seconds(fp32, state, h100)


def test_every_plan_has_its_levers_and_each_of_them_in_json(on_h100):
    doc = on_h100.to_json()
    assert len(doc["plans"]) == len(on_h100.results)
    for plan, r in zip(doc["plans"], on_h100.results):
        assert {k: plan[k] for k in LEVERS} == {k: getattr(r.plan, k) for k in LEVERS}, r.plan.name
        assert plan["memory"] == (EAGER_MEMORY if r.plan.compile else "fake step")
    configured = next(r for r in on_h100.results if r.plan.configured)
    assert configured.plan.name == "fp32 mb2x1"  # the config's own plan, as it is
    assert all(r.plan.fused_optimizer == (r.plan.offload == "none") and r.plan.tf32 == (r.plan.precision == "fp32")
               for r in on_h100.results if not r.plan.configured), "the levers an H100 allows an AdamW conv net"


def test_channels_last_plans_run_in_the_fake_step(on_h100):
    assert not on_h100.notes
    assert any(r.plan.channels_last for r in on_h100.results)


def test_the_levers_are_predicted_faster_on_an_h100():
    """Same measured step, priced with and without the levers: TF32 for the head's matmul, channels_last and
    the benchmark for the convolutions, one fused pass for the optimizer. The tiny net's step is paced by the host
    (its operators), which the kernel levers do not speed up; its FLOPs and bytes scaled up to a large model's, the
    kernels set the pace and every lever is faster."""
    cfg, h100 = _conv_cfg(), gpu("H100")
    with fake_process_group(1):
        m = measure_step(on_target(cfg, h100), full=True, steps=1, cuda=True)
    assert 0 < m.conv_flops < m.flops and m.step_ops > 0  # convolutions and the head's matmul; foreach's step
    plain = Plan("fp32", micro_batch=2)
    levers = [replace(plain, **{k: True}) for k in LEVERS if k != "compile"]

    def seconds(step) -> dict:
        return {p: plan_result(p, step, step, h100, 1, 1).seconds for p in (plain, *levers)}

    tiny = seconds(m)
    assert all(tiny[p] == tiny[plain] for p in levers if not p.fused_optimizer), tiny
    large = seconds(replace(m, flops=m.flops * 10**4, conv_flops=m.conv_flops * 10**4, written=m.written * 10**4))
    assert all(t < large[plain] for p, t in large.items() if p != plain), large


def test_compiled_twins_have_their_eager_plans_memory(on_h100):
    by_plan = {r.plan: r for r in on_h100.results}
    twins = [r for r in on_h100.results if r.plan.compile]
    assert twins and len(twins) == sum(not r.plan.compile and not r.plan.configured for r in on_h100.results)
    for twin in twins:
        eager = by_plan[replace(twin.plan, compile=False)]
        if twin.source == eager.source == "composed":  # a recommended plan is verified by its whole fake step
            assert (twin.peak_bytes, twin.allocated, twin.reserved) == \
                (eager.peak_bytes, eager.allocated, eager.reserved), twin.plan.name
        # fewer kernels and fused memory-bound operators (cost.LEVER_FACTORS, measured on an H100)
        assert twin.seconds < eager.seconds, twin.plan.name
    assert "compile (twins of the plans; memory: the eager plan's)" in on_h100.levers.describe()


def test_a_config_with_every_switch_predicts_for_a_gpu_on_this_cpu(conv_facts):
    """TF32, cuDNN's benchmark and compile are left out of the fake step (a CPU has no device to switch, and
    compile's graphs are not predicted): the configured row is the eager step's, marked so."""
    cfg = _conv_cfg(compile=True, cfg=dict(tf32=True), env_cfg=dict(cudnn_benchmark=True))
    cfg["optim_wrapper"]["optimizer"]["fused"] = True
    pred = predict(cfg, device=gpu("H100"), as_is=True)
    (row,) = pred.results
    assert row.plan == Plan("fp32", micro_batch=2, compile=True, fused_optimizer=True, tf32=True, cudnn_benchmark=True)
    assert row.source == "measured"
    assert pred.to_json()["plans"][0]["memory"] == EAGER_MEMORY


def test_auto_fit_takes_compile():
    assert auto_fit_options(dict(budget="24GiB", compile=True)) == dict(budget="24GiB", compile=True)
