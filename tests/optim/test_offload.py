"""Optimizer offload: bit-equal training to the optimizer on the device (clipping, accumulation, LR
schedule, fp16 loss scaling, loaded weights), the optimizer state held apart as host memory, its
checkpoints interchangeable with a plain optimizer's, and one-line errors where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memfit.connector import setup
from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.optim.offload import OffloadedOptimizer
from memfit.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

ADAMW = dict(optimizer=dict(type="AdamW", lr=1e-2, weight_decay=0.05))


def _net(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 3))


def _build(offload: bool, optim: dict, model: nn.Module | None = None):
    return setup(copy.deepcopy(model or _net()), SingleDeviceStrategy(), optim, optimizer_offload=offload)


def _train(model, wrapper, steps: int, micro: int = 1, sched=None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * micro):
        with wrapper.optim_context(model):
            loss = model(torch.randn(4, 8, generator=g)).square().mean()
        wrapper.update_params(loss)
        losses.append(loss.item())
        if sched is not None and wrapper.should_update():
            sched.step()
    return losses


OPTIMS = {
    "adamw": ADAMW,
    "clip+accumulate": dict(ADAMW, clip_grad=dict(max_norm=0.05), accumulative_counts=2),
    "sgd-momentum+paramwise": dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-3),
                                   paramwise_cfg=dict(norm_decay_mult=0.0, custom_keys={"3.": dict(lr_mult=0.5)})),
    "fp16 loss scale": dict(ADAMW, type="AmpOptimWrapper", dtype="float16", loss_scale="dynamic"),
}


@pytest.mark.parametrize("name", OPTIMS)
@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")  # fp16 skips the first step
def test_training_is_bit_equal_to_the_device_optimizer(name):
    optim = OPTIMS[name]
    micro = optim.get("accumulative_counts", 1)
    (ref, w_ref), (off, w_off) = _build(False, optim), _build(True, optim)
    assert isinstance(w_off.optimizer, OffloadedOptimizer) and not isinstance(w_ref.optimizer, OffloadedOptimizer)
    s_ref = torch.optim.lr_scheduler.LinearLR(w_ref.optimizer, start_factor=0.1, total_iters=3)
    s_off = torch.optim.lr_scheduler.LinearLR(w_off.optimizer, start_factor=0.1, total_iters=3)
    assert _train(ref, w_ref, 5, micro, s_ref) == _train(off, w_off, 5, micro, s_off)
    for (n, a), b in zip(ref.named_parameters(), off.parameters()):
        assert torch.equal(a, b), n
    # The state dicts are the same, in torch's format; the offloaded one's tensors live on the host.
    sd_ref, sd_off = w_ref.optimizer.state_dict(), w_off.optimizer.state_dict()
    assert sd_ref["param_groups"] == sd_off["param_groups"]
    for k, state in sd_ref["state"].items():
        for key, v in state.items():
            assert torch.equal(v, sd_off["state"][k][key]), (k, key)
    host = w_off.optimizer.host_optimizer
    assert all(h is not p for h, p in zip(host.param_groups[0]["params"], off.parameters()))


def test_weights_loaded_after_building_are_what_the_host_steps():
    # load_from and resume write the device parameters after the optimizer was built: the host copy
    # must follow them, or the first step would bring back the initial weights.
    other = _net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    (ref, w_ref), (off, w_off) = _build(False, ADAMW), _build(True, ADAMW)
    ref.load_state_dict(other.state_dict())
    off.load_state_dict(other.state_dict())
    _train(ref, w_ref, 2)
    _train(off, w_off, 2)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), off.parameters()))


def test_checkpoints_load_across_offload_either_way():
    (ref, w_ref), (off, w_off) = _build(False, ADAMW), _build(True, ADAMW)
    _train(ref, w_ref, 3)
    _train(off, w_off, 3)
    # Plain -> offloaded and offloaded -> plain: the next steps equal the uninterrupted runs.
    (a, w_a), (b, w_b) = _build(True, ADAMW, ref), _build(False, ADAMW, off)
    w_a.optimizer.load_state_dict(copy.deepcopy(w_ref.optimizer.state_dict()))  # as read from a file
    w_b.optimizer.load_state_dict(copy.deepcopy(w_off.optimizer.state_dict()))
    assert all(v.device.type == "cpu" for s in w_a.optimizer.host_optimizer.state.values() for v in s.values())
    for model, wrapper in ((ref, w_ref), (a, w_a), (b, w_b)):
        _train(model, wrapper, 2)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(ref.parameters(), a.parameters(),
                                                                           b.parameters()))


def _peaks(offload: bool) -> tuple[MemoryTracker, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    model, wrapper = setup(model, SingleDeviceStrategy(), ADAMW, optimizer_offload=offload)
    x = torch.randn(8, 256)
    wrapper.update_params(model(x).square().mean())  # the state exists from the first step on
    with MemoryTracker(model, wrapper.optimizer) as tracker:
        for _ in range(2):
            wrapper.update_params(model(x).square().mean())
    return tracker, sum(p.numel() for p in model.parameters())


def test_device_memory_saved_is_the_optimizer_state():
    plain, n = _peaks(False)
    off, _ = _peaks(True)
    state = 2 * 4 * n  # AdamW's exp_avg and exp_avg_sq, fp32
    assert plain.breakdown["optimizer_state"] >= state and off.breakdown["optimizer_state"] == 0
    # The device holds at least the state less (here the backward becomes the peak: more is saved).
    assert plain.peak_bytes - off.peak_bytes >= state
    # The host holds the parameters' fp32 copy and the state (plus the step's temporaries).
    assert off.host_peak_bytes >= 4 * n + state and plain.host_peak_bytes == 0
    assert "host (offloaded)" in off.report()


@pytest.mark.parametrize("strategy,kw,match", [
    (lambda: DDPStrategy(zero=True), {}, "ZeRO-1"),
    (lambda: FSDPStrategy(cpu_offload=True), {}, "cpu_offload=True"),
    (SingleDeviceStrategy, dict(optimizer_in_backward=True), "optimizer_in_backward"),
    (SingleDeviceStrategy, dict(precision=dict(opt_level="O2")), "opt_level='O2'"),
])
def test_combinations_that_cannot_work_are_one_line_errors(strategy, kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        setup(_net(), strategy(), dict(ADAMW), optimizer_offload=True, **kw)
    assert "\n" not in str(err.value)


def test_a_backend_with_its_own_offload_is_pointed_to_it():
    from memfit.connector import _check_offload
    from memfit.precision import Precision
    from memfit.strategies import Capabilities

    class OwnOffload(SingleDeviceStrategy):  # what it declares is what the check reads, not its name
        capabilities = Capabilities(own_offload="zero_optimization=dict(offload_optimizer=dict(device='cpu'))")

    with pytest.raises(ConfigError, match="OwnOffload offloads its own optimizer: use zero_optimization=dict"):
        _check_offload(OwnOffload(), Precision(), False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: pinned host copies and device memory")
def test_cuda_device_memory_saved():
    def peak(offload: bool) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
        model, wrapper = setup(model, SingleDeviceStrategy(), ADAMW, optimizer_offload=offload)
        x = torch.randn(64, 1024, device="cuda")
        for _ in range(2):
            wrapper.update_params(model(x).square().mean())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        wrapper.update_params(model(x).square().mean())
        return torch.cuda.max_memory_allocated()

    n = 8 * (1024 * 1024 + 1024)
    assert peak(False) - peak(True) >= 2 * 4 * n


def test_the_runner_switch_trains_as_without_it(tmp_path, caplog):
    import json
    import logging

    from memfit.model import BaseModel
    from memfit.runner import Runner

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, img, label, mode="tensor", **_):
            logits = self.net(img.flatten(1)[:, :8])
            return {"loss": nn.functional.cross_entropy(logits, label % 3)} if mode == "loss" else logits

    def train(name, offload):
        Runner(model=Net(), work_dir=str(tmp_path / name),
               train_dataloader=dict(batch_size=4, dataset=dict(type="ShapesDataset", num_samples=16, image_size=8)),
               train_cfg=dict(by_epoch=False, max_iters=4), optim_wrapper=ADAMW,
               default_hooks=dict(logger=dict(interval=1), checkpoint=None), randomness=dict(seed=0),
               cfg=dict(optimizer_offload=offload)).train()
        rows = next((tmp_path / name).glob("*/scalars.jsonl")).read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows]

    with caplog.at_level(logging.INFO, logger="memfit"):
        offloaded = train("off", True)
    assert "optimizer offload: AdamW's state and step on the host" in caplog.text
    assert offloaded == train("plain", False)
