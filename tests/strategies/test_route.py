"""route_forward: the model's own forward and train_step run through a backend's wrapper once."""

from __future__ import annotations

import copy

import torch
from torch import nn

from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.model import BaseModel
from memfit.optim import OptimWrapper
from memfit.strategies.route import route_forward, routed_wrapper, unroute


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y=None, mode="tensor"):
        out = self.fc(x)
        return {"loss": out.square().mean()} if mode == "loss" else out


class Counting(nn.Module):
    """A stand-in for DDP / DeepSpeed's engine: counts calls, then calls the module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def test_forward_and_train_step_go_through_the_wrapper_once():
    net = Net()
    wrapper = Counting(net)
    route_forward(net, wrapper)
    x = torch.randn(3, 4)
    expected = net.fc(x)
    assert torch.equal(net(x), expected) and wrapper.calls == 1
    net.train_step((x,), OptimWrapper(torch.optim.SGD(net.parameters(), lr=0.1)))
    assert wrapper.calls == 2
    assert routed_wrapper(net) is wrapper and list(net.state_dict()) == ["fc.weight", "fc.bias"]


def test_when_and_prepare():
    net = Net()
    wrapper = Counting(net)
    route_forward(net, wrapper, when=torch.is_grad_enabled,
                  prepare=lambda args, kwargs: ((args[0] * 0,), kwargs))
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(net(x), net.fc(x))  # evaluation: not routed, inputs untouched
    assert wrapper.calls == 0
    assert torch.equal(net(x), net.fc.bias.expand(3, 2)) and wrapper.calls == 1


def test_wrapper_follows_train_and_eval_mode():
    net = Net()
    wrapper = Counting(net)
    route_forward(net, wrapper)
    net.eval()
    net(torch.randn(1, 4))
    assert not wrapper.training
    net.train()
    net(torch.randn(1, 4))
    assert wrapper.training


def test_an_instance_forward_installed_before_is_kept_and_restored():
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    apply_activation_checkpointing(net, [""])  # the root checkpointed: its forward is replaced in place
    checkpointed = net.forward
    wrapper = Counting(net)
    route_forward(net, wrapper)
    out = net(torch.randn(2, 4, requires_grad=True))
    out.sum().backward()
    assert wrapper.calls == 1 and net[0].weight.grad is not None
    unroute(net)
    assert net.forward is checkpointed and routed_wrapper(net) is None
    net(torch.randn(2, 4))
    assert wrapper.calls == 1


def test_the_models_own_hooks_run_once_per_call():
    """ZeRO-3 installs hooks on every module, the root included: the outer (routed) call must not run
    them, only the wrapper's call back into the model."""
    net = Net()
    wrapper = Counting(net)
    calls = []
    net.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    net.register_forward_hook(lambda m, args, out: calls.append("post"))
    route_forward(net, wrapper)
    net(torch.randn(2, 4))
    assert calls == ["pre", "post"] and wrapper.calls == 1


def test_a_copy_runs_its_own_forward():
    net = Net()
    wrapper = Counting(net)
    route_forward(net, wrapper)
    clone = copy.deepcopy(net)
    with torch.no_grad():
        clone.fc.weight.zero_()
        clone.fc.bias.zero_()
    out = clone(torch.randn(2, 4))
    assert wrapper.calls == 0 and torch.equal(out, torch.zeros(2, 2))
    assert routed_wrapper(clone) is None
