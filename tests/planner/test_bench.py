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


class _Event:
    def __init__(self, name: str, start: int, duration: int, cuda: bool = False) -> None:
        self._args = name, start, duration, cuda

    def name(self) -> str:
        return self._args[0]

    def start_ns(self) -> int:
        return self._args[1]

    def duration_ns(self) -> int:
        return self._args[2]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._args[3] else torch.autograd.DeviceType.CPU


def test_a_profiled_step_tells_the_hosts_time_from_the_devices():
    """The device's busy time is the union of its kernels' intervals (two streams overlapping count once); the
    host's waits are its synchronisations and its launches; aten operators and kernels are counted."""
    from memfit.planner.step_profile import summarize

    events = [_Event("aten::mm", 0, 5_000), _Event("cudaLaunchKernel", 1_000, 2_000), _Event("aten::add", 6_000, 1_000),
              _Event("cudaStreamSynchronize", 8_000, 30_000), _Event("gemm_kernel", 3_000, 20_000, cuda=True),
              _Event("ncclKernel_AllGather", 10_000, 20_000, cuda=True),  # on another stream: overlaps the gemm
              _Event("Memcpy HtoD (Pageable -> Device)", 40_000, 1_000, cuda=True)]
    s = summarize(events, wall_s=50e-6)
    assert s["device_busy_s"] == pytest.approx(28e-6)  # 3..30 us and 40..41 us
    assert (s["kernels"], s["aten_ops"]) == (2, 2)  # the copy is device time, not a kernel
    assert (s["sync_wait_s"], s["launch_s"]) == (pytest.approx(30e-6), pytest.approx(2e-6))
    assert s["host_in_ops_s"] == pytest.approx(6e-6)  # mm 0..5 us, add 6..7 us
    assert s["top_ops"] == [("aten::mm", 1, pytest.approx(5e-6)), ("aten::add", 1, pytest.approx(1e-6))]
    assert s["device_s_by_family"] == pytest.approx({"matmul": 20e-6, "communication": 20e-6, "copy": 1e-6})
    assert [k[:2] for k in s["top_kernels"]] == [("gemm_kernel", 1), ("ncclKernel_AllGather", 1),
                                                  ("Memcpy HtoD (Pageable -> Device)", 1)]
    assert summarize([_Event("aten::mm", 0, 5)], 1.0)["device_busy_s"] is None  # a CPU step: no device


def test_a_profiled_step_keeps_where_in_the_step_the_device_waited():
    """The timeline: the step cut into equal windows, each with the device's busy seconds (a kernel across two
    windows split between them) and the host's operators, launches and synchronisations begun there. Here the
    first half keeps the device busy and the second leaves it waiting for two Python operators."""
    from memfit.planner.step_profile import summarize

    events = [_Event("aten::mm", 0, 1_000), _Event("cudaLaunchKernel", 500, 400),
              _Event("gemm_kernel", 1_000, 4_500, cuda=True),
              _Event("aten::index", 6_000, 1_500), _Event("aten::nonzero", 8_000, 1_000),
              _Event("cudaStreamSynchronize", 8_200, 500), _Event("tiny_kernel", 9_000, 200, cuda=True),
              _Event("aten::add", 9_500, 500)]
    t = summarize(events, wall_s=10e-6, windows=4)["timeline"]
    assert t["window_s"] == pytest.approx(2.5e-6)
    assert t["device_busy_s"] == pytest.approx([1.5e-6, 2.5e-6, 0.5e-6, 0.2e-6])
    assert (t["aten_ops"], t["launches"], t["syncs"]) == ([1, 0, 1, 2], [1, 0, 0, 0], [0, 0, 0, 1])
    assert t["launches_s"] == pytest.approx([0.4e-6, 0, 0, 0]) and t["syncs_s"] == pytest.approx([0, 0, 0, 0.5e-6])
    assert summarize([_Event("aten::mm", 0, 5)], 1.0)["timeline"] is None  # a CPU step: no device to compare with


def test_what_paced_a_profiled_step():
    """`memfit bench` on a GPU puts this beside the planner's 'paced by': the device where its kernels kept it busy
    for nine tenths of the step or more, else the host."""
    from memfit.planner.step_profile import paced_by

    kernels = [_Event("aten::mm", 0, 1_000), _Event("gemm_kernel", 1_000, 9_000, cuda=True)]
    assert paced_by(summarize_of(kernels, 10e-6)) == "device"
    assert paced_by(summarize_of(kernels, 12e-6)) == "host"  # 9 of 12 us busy: the GPU waited 3 us for Python
    assert paced_by(summarize_of([_Event("aten::mm", 0, 5)], 1.0)) is None  # a CPU step


def summarize_of(events, wall_s):
    from memfit.planner.step_profile import summarize

    return summarize(events, wall_s)


@pytest.mark.parametrize("kernel, family", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"), ("nvjet_hsh_256x128_64x4", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32", "convolution"), ("cudnn::bn_fw_tr_1C11_kernel_NCHW", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("Memset (Device)", "copy"), ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication")])
def test_kernels_are_told_apart_by_family(kernel, family):
    from memfit.planner.step_profile import family as family_of

    assert family_of(kernel) == family


def test_measure_plan_profiles_one_more_step_when_asked(tiny_config, tmp_path):
    cfg = Config.fromfile(tiny_config(tmp_path)).to_dict()
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    plan = configured_plan(cfg, facts, cuda=False)
    assert measure_plan(cfg, plan, facts, steps=1).profile == {}
    p = measure_plan(cfg, plan, facts, steps=1, profile=True).profile
    assert p["aten_ops"] > 20 and p["wall_s"] > 0 and p["device_busy_s"] is None  # forward, backward, step on a CPU
