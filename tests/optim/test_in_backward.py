"""Optimizer step in backward: same parameters as a normal optimizer, schedulers and checkpoints work,
and the full set of gradients is never alive at once."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.optim.in_backward import OptimizerInBackward, check_in_backward_compatible
from memfit.optim.param_groups import build_param_groups

FACTORIES = {
    "SGD-momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "AdamW": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.05),
}


def _mlp(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, sched: object = None, dim: int = 8
) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, dim, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("name", FACTORIES)
def test_parameters_equal_normal_optimizer(name: str) -> None:
    factory = FACTORIES[name]
    ref, fused = _mlp(), _mlp()
    groups = functools.partial(build_param_groups, lr=factory.keywords["lr"],
                               weight_decay=factory.keywords["weight_decay"],
                               paramwise_cfg=dict(norm_decay_mult=0.0, custom_keys={"3.": dict(lr_mult=0.5)}))
    opt_ref = factory(groups(ref))
    opt = OptimizerInBackward(groups(fused), factory)
    _train(ref, opt_ref, 5)
    _train(fused, opt, 5)
    for (n, a), b in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=n)
        assert b.grad is None  # freed in backward
    # Same state_dict as the normal optimizer, in torch's format.
    sd_ref, sd = opt_ref.state_dict(), opt.state_dict()
    assert sd["param_groups"] == sd_ref["param_groups"]
    assert sd["state"].keys() == sd_ref["state"].keys()
    for k in sd["state"]:
        for key, v in sd["state"][k].items():
            torch.testing.assert_close(v, sd_ref["state"][k][key], atol=1e-6, rtol=0)


def test_scheduler_lr_reaches_each_per_param_optimizer() -> None:
    factory = FACTORIES["SGD-momentum"]
    ref, fused = _mlp(), _mlp()
    opt_ref, opt = factory(ref.parameters()), OptimizerInBackward(fused.parameters(), factory)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=2, gamma=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    _train(ref, opt_ref, 5, sched_ref)
    _train(fused, opt, 5, sched)
    for a, b in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    # lr after 5 scheduler steps is 0.1 * 0.1**2; every inner optimizer used it on its last step.
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    _train(fused, opt, 1)
    assert all(inner.param_groups[0]["lr"] == pytest.approx(1e-3) for inner in opt.optimizers.values())


@pytest.mark.parametrize("name", FACTORIES)
def test_state_dict_round_trip(name: str) -> None:
    factory = FACTORIES[name]
    model = _mlp()
    opt = OptimizerInBackward(model.parameters(), factory)
    _train(model, opt, 3)
    state = copy.deepcopy(opt.state_dict())
    opt.remove_hooks()
    twin = _mlp()
    twin.load_state_dict(model.state_dict())
    opt2 = OptimizerInBackward(twin.parameters(), factory)
    opt2.load_state_dict(copy.deepcopy(state))
    sd2 = opt2.state_dict()
    assert sd2["param_groups"] == state["param_groups"]
    for k, v in state["state"].items():
        for key, t in v.items():
            torch.testing.assert_close(sd2["state"][k][key], t, atol=0, rtol=0)
    # Continuing from the loaded state equals continuing with a normal optimizer loaded the same way.
    ref = _mlp()
    ref.load_state_dict(twin.state_dict())
    opt_ref = factory(ref.parameters())
    opt_ref.load_state_dict(copy.deepcopy(state))  # load_state_dict keeps the tensors: no sharing
    _train(twin, opt2, 2)
    _train(ref, opt_ref, 2)
    for a, b in zip(ref.parameters(), twin.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_incompatible_options_are_refused() -> None:
    check_in_backward_compatible(1, None)
    with pytest.raises(ConfigError, match="set accumulative_counts=1 / remove clip_grad"):
        check_in_backward_compatible(4, dict(max_norm=1.0))
    with pytest.raises(ConfigError, match="bfloat16"):
        check_in_backward_compatible(1, None, grad_scaler=torch.amp.GradScaler("cpu"))


def test_peak_memory_lower_gradients_not_all_live() -> None:
    def peak(opt_builder: object) -> tuple[int, dict[str, int], int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
        opt = opt_builder(model.parameters())
        x = torch.randn(4, 512)
        _train(model, opt, 1, dim=512)  # optimizer state exists from here on
        with MemoryTracker(model, opt) as tracker:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return tracker.peak_bytes, tracker.breakdown, sum(p.numel() * 4 for p in model.parameters())

    sgd = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    normal, normal_bd, param_bytes = peak(sgd)
    fused, fused_bd, _ = peak(lambda params: OptimizerInBackward(params, sgd))
    assert normal_bd["gradients"] >= 0.8 * param_bytes  # (nearly) all gradients live together
    # In backward: at most the gradients of one layer plus the step's temporaries.
    assert fused_bd["gradients"] <= param_bytes / 4
    # Measured: 24.1 -> 17.1 MiB (8.0 MiB of parameters): the gradients' memory is gone from the peak.
    assert normal - fused >= 0.5 * param_bytes, (normal, fused, param_bytes)
