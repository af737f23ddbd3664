"""fp32 islands: matched modules run in float32 under autocast, gradients flow, bad names are errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.precision.fp32_islands import apply_fp32_islands


class Loss(nn.Module):
    def forward(self, pred: torch.Tensor, target: dict) -> torch.Tensor:
        self.seen = (pred.dtype, target["y"][0].dtype)  # what the loss computes with
        return (pred - target["y"][0]).square().mean()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.loss = Loss()
        self.seen: dict[str, torch.dtype] = {}
        for name in ("stem", "head.0", "head.2"):
            self.get_submodule(name).register_forward_hook(
                lambda m, i, o, name=name: self.seen.__setitem__(name, (i[0].dtype, o.dtype))
            )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.head(self.stem(x)), {"y": [y.bfloat16()]})


def test_island_runs_fp32_outside_bf16_and_gradients_flow() -> None:
    torch.manual_seed(0)
    net = Net()
    assert apply_fp32_islands(net, ["head.2", "Loss"]) == ["head.2", "loss"]
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net(x, y)
    # Outside the island: bf16 output; inside: its bf16 input was cast to fp32 and it ran in fp32.
    assert net.seen["stem"][1] == torch.bfloat16 and net.seen["head.0"][1] == torch.bfloat16
    # Hooks see the call's arguments (bf16); the output shows the Linear ran in fp32 (with autocast
    # off, a bf16 input against its fp32 weight would have raised).
    assert net.seen["head.2"] == (torch.bfloat16, torch.float32)
    assert net.loss.seen == (torch.float32, torch.float32)  # nested inputs were cast too
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    # Outside autocast nothing changes, and the module objects and state_dict keys are the same.
    net.seen.clear()
    net(x, y)
    assert net.seen["head.2"] == (torch.float32, torch.float32)
    assert list(net.state_dict()) == list(Net().state_dict())


def test_island_matches_outputs_of_fp32_reference() -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 8)
    head_in = net.stem(x)
    ref = net.head[2](net.head[1](net.head[0](head_in)))
    apply_fp32_islands(net, ["head"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net.head(head_in)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # whole head in fp32: bit-exact


def test_name_suffix_glob_nesting_and_idempotence() -> None:
    net = Net()
    assert apply_fp32_islands(net, ["*.2"]) == ["head.2"]
    # 'head' encloses the earlier island head.2: only the outer one is reported.
    assert apply_fp32_islands(net, ["head", "Linear"]) == ["stem", "head"]
    assert apply_fp32_islands(net, ["head"]) == ["head"]  # again: nothing wrapped twice
    calls = []
    net.head.register_forward_hook(lambda *a: calls.append(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(1, 8), torch.randn(1, 4))
    assert calls == [1]


def test_unknown_entry_lists_names_and_types() -> None:
    with pytest.raises(ConfigError, match="'heda' matches no module name or type: did you mean 'head'"):
        apply_fp32_islands(Net(), ["heda"])
    with pytest.raises(ConfigError, match="'Linaer'.*did you mean 'Linear'"):
        apply_fp32_islands(Net(), ["Linaer"])
