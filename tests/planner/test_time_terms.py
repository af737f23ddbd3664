"""The step-time model's terms added with the calibrated profiles: fused attention's FLOPs (the CPU fake step's
flash attention, which torch's counter has no formula for), selective checkpointing's host cost per recomputed
operator, FSDP's host work per parameter tensor, the host optimizer's rate, and the margin a CUDA row must leave
free to fit, by how it was predicted."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from memfit.planner.cost import (
    FSDP_TENSOR_US,
    HOST_OP_FACTOR,
    HOST_STEP_BYTES_PER_S,
    SELECTIVE_OP_US,
    ModelState,
    micro_step_seconds,
    step_time,
)
from memfit.planner.devices import gpu, this_cpu
from memfit.planner.fake import Phase, StepMeasurement, fake_process_group, measure_step
from memfit.planner.predict import _rank
from memfit.planner.results import FIT_MARGINS, PlanResult, fit_margin
from memfit.planner.space import Plan
from memfit.planner.time_profile import Profile

VIT = dict(type="TimmClassifier", model_name="vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8,
           embed_dim=64, depth=2, num_heads=2, drop_path_rate=0.0)


def test_the_fake_step_counts_fused_attention():
    data = dict(type="ShapesDataset", image_size=32, num_classes=4, num_samples=8)
    cfg = dict(model=VIT, optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
               train_dataloader=dict(batch_size=2, num_workers=0, dataset=data, sampler=dict(type="DefaultSampler")),
               strategy=dict(type="SingleDeviceStrategy"))
    with fake_process_group(1):
        m = measure_step(cfg, full=False, cuda=True)
    shape = torch.Size((2, 2, 17, 32))  # batch, heads, 4x4 patches and the class token, head width
    per_layer = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    assert m.attn_flops == 2 * per_layer  # two blocks, forward and backward (flash's backward recomputes scores)
    assert 0 < m.attn_flops < m.flops


def test_attention_and_selective_terms_on_a_gpu(constants_time_model):
    h100 = gpu("H100")
    attn = StepMeasurement(0, {}, Phase(), Phase(), flops=10**13, attn_flops=10**13)
    bf16 = Plan("bf16")
    profile = Profile("H100", "", "hopper", {"matmul": {"bf16": 0.8}, "attention": {"bf16": 0.4}})
    assert micro_step_seconds(bf16, attn, h100, profile) == pytest.approx(10 / (989 * 0.4))  # attention's own rate
    assert micro_step_seconds(bf16, attn, h100, Profile("H100", "", "hopper", {"matmul": {"bf16": 0.8}})) == \
        pytest.approx(10 / (989 * 0.8))  # a profile without it: a matmul's
    recomputed = StepMeasurement(0, {}, Phase(), Phase(), ops=1000, recompute_ops=400)
    plain = micro_step_seconds(Plan("bf16", "blocks"), recomputed, h100)
    assert micro_step_seconds(Plan("bf16", "selective"), recomputed, h100) == pytest.approx(
        plain + 400 * SELECTIVE_OP_US * 1e-6)
    assert micro_step_seconds(Plan("bf16", "selective"), recomputed, h100, Profile("H100", "", "hopper", {
        "selective_op_us": 5.0})) == pytest.approx(micro_step_seconds(Plan("bf16", "blocks"), recomputed, h100, Profile(
            "H100", "", "hopper", {})) + 400 * 5e-6)


def test_a_row_fits_with_the_margin_its_kind_needs():
    h100, budget = gpu("H100"), 100 * 2**30

    def row(source: str, **plan) -> PlanResult:
        return PlanResult(Plan("bf16", **plan), int(0.94 * budget), {}, 0, 0, 1.0, source)

    rows = [row("measured"), row("composed"), row("composed", sharding="fsdp"), row("measured", offload="optimizer")]
    beside = FIT_MARGINS["sharded or offloaded"]
    assert [fit_margin(r, h100) for r in rows] == [FIT_MARGINS["measured"], FIT_MARGINS["composed"], beside, beside]
    _rank(rows, budget, h100)
    assert [r.fits for r in rows] == [True, True, False, False]  # 94% of the budget: inside 4% and 5%, not 8%
    cpu_rows = [replace(r) for r in rows]
    _rank(cpu_rows, budget, this_cpu(0.001))
    assert all(r.fits for r in cpu_rows)  # a CPU target's figures are its live tensor bytes: no margin
    # A detector's rows (its input has boxes) keep the larger margin DINO's measured errors need, whatever their kind.
    assert {fit_margin(r, h100, detection=True) for r in rows} == {FIT_MARGINS["detection"]}
    near = [replace(r, peak_bytes=int(0.91 * budget)) for r in rows]
    _rank(near, budget, h100, detection=True)
    assert not any(r.fits for r in near)  # 91% of the budget: outside 11%
    _rank(near, budget, h100)
    assert all(r.fits for r in near)


def test_fsdp_host_work_per_parameter_tensor_and_the_host_optimizer_rate(constants_time_model):
    h100, cpu = gpu("H100"), this_cpu()
    state = ModelState(params=4 * 10**8, grads=4 * 10**8, optimizer=8 * 10**8, tensors=300)
    micro = StepMeasurement(0, {}, Phase(), Phase(), flops=10**13, ops=2000)
    per = FSDP_TENSOR_US * 1e-6 * 300

    def seconds(plan: Plan, device=h100, profile: Profile | None = None) -> float:
        with patch("memfit.planner.cost.profile_for", lambda d: (profile or Profile("x"), False)):
            return step_time(plan, micro, micro, state, device, 1, 1).seconds

    plain = seconds(Plan("bf16"))
    # FSDP gathers every tensor in forward and again in backward, each micro-step, and reduces it once a step;
    # ZeRO-2 keeps the gathered parameters until backward.
    assert seconds(Plan("bf16", sharding="fsdp")) == pytest.approx(plain + 3 * per)
    # (and a second micro-step adds each of the 300 gradients to the first's: an operator each)
    assert seconds(Plan("bf16", sharding="fsdp", accumulative_counts=2)) == pytest.approx(
        2 * plain + 5 * per + 300 * 20e-6 * HOST_OP_FACTOR, rel=0.02)
    assert seconds(Plan("bf16", sharding="zero2")) == pytest.approx(plain + 2 * per)
    assert seconds(Plan("bf16", sharding="fsdp"), profile=Profile("x", factors={"fsdp_tensor_us": 10.0})) == \
        pytest.approx(seconds(Plan("bf16"), profile=Profile("x")) + 3 * 300 * 10e-6)
    assert seconds(Plan("fp32", sharding="fsdp"), cpu) == seconds(Plan("fp32"), cpu)  # a CPU target: no CUDA host work
    # An offloaded optimizer steps on the host at the profile's measured rate, else the constant's.
    moved = state.params + state.grads + 2 * state.optimizer
    offload = Plan("bf16", offload="optimizer")
    assert seconds(offload) - seconds(offload, profile=Profile("x", factors={"host_step_gbps": 40.0})) == \
        pytest.approx(moved / HOST_STEP_BYTES_PER_S - moved / 40e9)



def test_what_paces_a_step(constants_time_model):
    """A step's parts, and the largest of them named (the plan table's 'paced by'): on a GPU many small operators
    leave the device waiting for Python, FLOPs the other way round; an offloaded optimizer's copies and host step, and
    a large all-reduce over a slow link, take longer than either. A CPU runs its operators as it dispatches them."""
    h100 = gpu("H100")
    state = ModelState(params=4 * 10**8, grads=4 * 10**8, optimizer=8 * 10**8, tensors=300)
    small = StepMeasurement(0, {}, Phase(), Phase(), flops=10**9, ops=20000)
    large = StepMeasurement(0, {}, Phase(), Phase(), flops=10**16, ops=2000)

    def time(plan: Plan, micro: StepMeasurement, device=h100, world: int = 1):
        return step_time(plan, micro, micro, state, device, world, 1)

    host, device = time(Plan("bf16"), small), time(Plan("bf16"), large)
    assert (host.bound, device.bound) == ("host", "device")
    assert host.seconds == host.host and device.seconds == device.kernels
    few = replace(small, ops=200)
    assert time(Plan("bf16", offload="optimizer"), few).bound == "offload"
    assert time(Plan("bf16"), few, gpu("4090"), world=8).bound == "comm"  # a DDP all-reduce of 400 MB over PCIe
    cpu = time(Plan("fp32"), small, this_cpu())
    assert cpu.bound == "device" and cpu.seconds == pytest.approx(cpu.kernels + cpu.host)


@pytest.mark.parametrize("offload", [False, True])
def test_the_optimizer_state_a_step_touches_is_the_state_it_keeps(offload):
    """AdamW keeps two moments (8 bytes a parameter); its foreach step's peak holds temporaries beside them (DeiT-B:
    a third moment's worth), which the optimizer's time is not about: counted, an offloaded row (whose state is that
    of its sharding's step on the device) was a third over its time on the H100 (DeiT-B). On the host the state is
    its peak there less the parameters' copy (and the CPU step's temporaries, a parameter at a time)."""
    from memfit.planner.results import model_state

    data = dict(type="ShapesDataset", image_size=32, num_classes=4, num_samples=8)
    cfg = dict(model=VIT, optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)),
               train_dataloader=dict(batch_size=2, num_workers=0, dataset=data, sampler=dict(type="DefaultSampler")),
               strategy=dict(type="SingleDeviceStrategy"), optimizer_offload=offload)
    with fake_process_group(1):
        m = measure_step(cfg, full=True, steps=1, cuda=True)
    state = model_state(m)
    assert state.params == state.grads > 0
    if offload:
        assert 2 * state.params <= state.optimizer <= 2.4 * state.params
    else:
        assert m.optimizer.breakdown["optimizer_state"] > 2.2 * state.params  # foreach's temporaries at the peak
        assert state.optimizer == pytest.approx(2 * state.params, rel=0.01)  # the moments (and the step counters)
