"""MemoryMonitorHook: measures the logged iterations through the runner and leaves nothing behind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import memfit.hooks.memory as memory_hook
from memfit.errors import ConfigError
from memfit.hooks.memory import MemoryMonitorHook
from memfit.logger import MessageHub
from memfit.measure import CATEGORIES, MB
from memfit.model import BaseModel
from memfit.runner import Runner


class MLP(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor, mode: str = "tensor") -> object:
        out = self.net(x)
        return {"loss": (out - y).pow(2).mean()} if mode == "loss" else (out, y)


def _data(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    return [(x[i], x[i].sum(0, keepdim=True)) for i in range(n)]


def test_measures_logged_iterations_through_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[int] = []

    class Counting(memory_hook.MemoryTracker):
        def __enter__(self) -> Counting:
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(memory_hook, "MemoryTracker", Counting)
    runner = Runner(
        model=MLP(),
        work_dir="work",
        train_dataloader=dict(
            batch_size=4, dataset=_data(), sampler=dict(type="DefaultSampler", shuffle=False)
        ),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01, momentum=0.9)),
        default_hooks=dict(checkpoint=None, logger=dict(interval=3)),
        custom_hooks=[dict(type="MemoryMonitorHook")],
    )
    runner.train()
    assert len(entered) == 3  # iterations 3 and 6 (the logger's interval) and 8 (last of the epoch)
    hub = runner.message_hub
    params = sum(p.numel() * 4 for p in runner.model.parameters())
    assert hub.latest("memory/parameters_mb") == params / MB
    assert hub.latest("memory/optimizer_state_mb") == params / MB  # SGD momentum buffers
    parts = sum(hub.latest(f"memory/{c}_mb") for c in CATEGORIES)
    assert hub.latest("memory/peak_mb") == pytest.approx(parts, rel=1e-12)
    assert hub.latest("memory/activations_mb") > 0
    if runner.device.type == "cpu":  # on CUDA the allocator's peak files inputs under activations (documented)
        assert hub.latest("memory/inputs_mb") > 0


def test_a_failed_iteration_leaves_no_dispatch_mode() -> None:
    model = nn.Linear(4, 4)
    runner = SimpleNamespace(model=model, optim_wrapper=None, message_hub=MessageHub(), hooks=[], iter=0,
                             train_loop=None)
    hook = MemoryMonitorHook(interval=1)
    hook.before_train_iter(runner, 0)
    assert _get_current_dispatch_mode() is not None
    # the step raised: no after_train_iter; the next iteration (or the end of the run) closes it
    hook.before_train_iter(runner, 0)
    hook.after_run(runner)
    assert _get_current_dispatch_mode() is None
    assert runner.message_hub.keys("memory/") == []


def test_bad_interval() -> None:
    with pytest.raises(ConfigError, match="interval must be a positive integer"):
        MemoryMonitorHook(interval=0)
