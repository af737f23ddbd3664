"""MemoryTracker with fp32 master weights (Apex O2): the masters are optimizer state, their gradients
gradients (tests/measure/test_tracker.py: the other parts of a step, fake tensors, FSDP2 and DDP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.connector import setup
from memfit.measure import MemoryTracker
from memfit.model import BaseModel
from memfit.strategies import SingleDeviceStrategy


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """test_measure.py's ``batch('mlp')``: 32 rows of 64 features and their labels."""
    x = torch.randn(32, 64)
    return x, torch.arange(x.shape[0]) % 10


class Classifier(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor, mode: str = "tensor") -> object:
        logits = self.net(x)
        return dict(loss=F.cross_entropy(logits.float(), y)) if mode == "loss" else logits


def test_fp32_master_weights_are_optimizer_state() -> None:
    """Apex O2 (bf16 model): the optimizer steps fp32 copies of the parameters; they are optimizer state
    (as ZeRO counts them), not inputs, and their gradients are gradients."""
    torch.manual_seed(0)
    strategy = SingleDeviceStrategy()
    strategy.setup_env()
    strategy.device = torch.device("cpu")  # the live-storage breakdown (on CUDA inputs fold into activations)
    model, wrapper = setup(Classifier(), strategy, dict(optimizer=dict(type="SGD", lr=0.1)),
                           precision=dict(opt_level="O2", dtype="bfloat16"))
    x, y = batch()
    model.train_step((x, y), optim_wrapper=wrapper)
    with MemoryTracker(model, wrapper.optimizer) as t:
        model.train_step((x, y), optim_wrapper=wrapper)
    n = sum(p.numel() for p in model.parameters())
    assert t.breakdown["parameters"] == 2 * n  # bf16
    assert t.breakdown["optimizer_state"] == 4 * n  # the fp32 masters (plain SGD keeps no state)
    assert t.breakdown["inputs"] == x.nbytes + y.nbytes
    assert t.breakdown["gradients"] > 2 * n  # at the peak: fp32 master gradients and the bf16 ones not yet moved
