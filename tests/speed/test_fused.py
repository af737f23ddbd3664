"""Fused optimizer steps (``optim_wrapper.optimizer.fused=True``, memfit.speed.fused): fused AdamW and SGD
train the weights torch's default (foreach) step trains, also under AmpOptimWrapper's fp16 GradScaler
(an overflowing step skipped) and with optimizer offload; the one-line errors. FSDP2:
tests/speed/test_strategies.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memfit.connector import setup
from memfit.errors import ConfigError
from memfit.speed import fused as fused_module
from memfit.strategies import SingleDeviceStrategy

# One kernel against foreach kernels: the same update in another order of fp32 operations (~1e-7 here).
TOL = dict(rtol=1e-5, atol=1e-6)
ADAMW = dict(type="AdamW", lr=1e-2, weight_decay=0.05)
SGD = dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-3)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def _train(optim: dict, fused: bool, offload: bool = False, overflow_at: int = -1) -> tuple[nn.Module, object]:
    optim = copy.deepcopy(optim)
    optim["optimizer"] = dict(optim["optimizer"], fused=True) if fused else optim["optimizer"]
    model, wrapper = setup(_net(), SingleDeviceStrategy(), optim, optimizer_offload=offload)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        with wrapper.optim_context(model):
            loss = model(torch.randn(4, 8, generator=g)).square().mean()
        wrapper.update_params(loss * float("inf") if step == overflow_at else loss)
    return model, wrapper


CASES = {
    "adamw": (dict(optimizer=ADAMW), {}),
    "sgd-momentum": (dict(optimizer=SGD), {}),
    "adamw fp16 GradScaler, an overflow skipped": (
        dict(type="AmpOptimWrapper", dtype="float16", loss_scale="dynamic", optimizer=ADAMW), dict(overflow_at=1)),
    "adamw offloaded": (dict(optimizer=ADAMW), dict(offload=True)),
}


@pytest.mark.parametrize("name", CASES)
def test_fused_trains_the_weights_of_the_default_step(name):
    optim, options = CASES[name]
    ref, ref_wrapper = _train(optim, fused=False, **options)
    got, wrapper = _train(optim, fused=True, **options)
    host = getattr(wrapper.optimizer, "host_optimizer", wrapper.optimizer)
    assert host.defaults["fused"] is True  # offloaded: the host optimizer is the fused one
    for (n, a), b in zip(ref.named_parameters(), got.parameters()):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    if "overflow_at" in options:
        assert int(wrapper.skipped_steps) == int(ref_wrapper.skipped_steps) >= 1  # the same steps skipped


@pytest.mark.parametrize("optimizer, message", [
    (dict(type="Lars", lr=0.1, fused=True),
     r"^optim_wrapper\.optimizer\.fused=True: Lars has no fused implementation; remove fused or use AdamW/Adam/SGD$"),
    (dict(ADAMW, fused=True, foreach=True),
     r"^optim_wrapper\.optimizer\.fused=True and optim_wrapper\.optimizer\.foreach=True: a step is one or the "
     r"other; remove foreach$"),
    (dict(ADAMW, fused="yes"), r"^optim_wrapper\.optimizer\.fused='yes': use True .* or remove it$"),
])
def test_fused_errors_are_one_line(optimizer, message):
    with pytest.raises(ConfigError, match=message):
        setup(_net(), SingleDeviceStrategy(), dict(optimizer=optimizer))


def test_fused_on_a_device_without_fused_kernels_is_one_line(monkeypatch):
    monkeypatch.setattr(fused_module, "fused_devices", lambda: ["cuda", "xpu"])
    with pytest.raises(ConfigError, match=r"^optim_wrapper\.optimizer\.fused=True: torch has no fused AdamW kernels "
                                          r"on cpu \(it has them on cuda, xpu\); remove fused$"):
        setup(_net(), SingleDeviceStrategy(), dict(optimizer=dict(ADAMW, fused=True)))


def test_fused_sgd_on_sharded_parameters_is_one_line():
    from torch.distributed.tensor import DTensor

    from memfit.speed.fused import check_fused

    class Sharded(DTensor):  # stands for FSDP2's parameters; only its type is read
        def __new__(cls):
            return torch.Tensor._make_subclass(cls, torch.zeros(1))

    with pytest.raises(ConfigError, match=r"^optim_wrapper\.optimizer\.fused=True: FSDP's sharded parameters have "
                                          r"fused kernels for Adam and AdamW only .*; remove fused or use AdamW$"):
        check_fused({"fused": True}, torch.optim.SGD, [Sharded()])
    check_fused({"fused": True}, torch.optim.AdamW, [torch.zeros(1)])  # plain tensors on the CPU: fine
