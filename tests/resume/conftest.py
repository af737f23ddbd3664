"""A small classifier with dropout and a builder for in-process runners, shared by tests/resume."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner


class DropoutNet(BaseModel):
    """Linear -> ReLU -> Dropout -> Linear over 4 features, 2 classes; ``width`` changes the shapes."""

    def __init__(self, width: int = 8, p: float = 0.3) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, 2)

    def forward(self, x, y, mode="tensor"):
        logits = self.head(self.drop(self.fc(x).relu()))
        if mode == "loss":
            return {"loss": F.cross_entropy(logits, y)}
        if mode == "predict":
            return logits.softmax(-1), y
        return logits


def samples(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return [(x[i], y[i]) for i in range(n)]


class Recorder(Hook):
    """Per iteration: (runner.iter, batch_idx, loss bits); per validation: the metrics."""

    def __init__(self) -> None:
        self.iters: list[tuple[int, int, float]] = []
        self.vals: list[dict] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.iters.append((runner.iter, batch_idx, outputs["loss"].item()))

    def after_val_epoch(self, runner, metrics=None) -> None:
        self.vals.append(dict(metrics or {}))


class ScriptedScore(Hook):
    """Adds ``score = scores[i]`` to the i-th validation's metrics (runs before the CheckpointHook)."""

    def __init__(self, scores: list[float], key: str = "score") -> None:
        self.scores, self.key, self.calls = list(scores), key, 0

    def after_val_epoch(self, runner, metrics=None) -> None:
        metrics[self.key] = self.scores[self.calls]
        self.calls += 1


def make_runner(work_dir: Any, *, model: nn.Module | dict | None = None, val: bool = False,
                **overrides: Any) -> Runner:
    """A seeded Runner over 32 samples, batch 4 (8 iterations per epoch), SGD with momentum, no
    checkpoints unless ``default_hooks`` says so; ``val=True`` adds validation with Accuracy."""
    kwargs: dict[str, Any] = dict(
        model=model if model is not None else dict(type=DropoutNet),
        work_dir=str(work_dir),
        train_dataloader=dict(batch_size=4, dataset=samples(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        default_hooks=dict(checkpoint=None, logger=dict(interval=100)),
        randomness=dict(seed=0),
    )
    if val:
        kwargs.update(val_dataloader=dict(batch_size=8, dataset=samples(16),
                                          sampler=dict(type="DefaultSampler", shuffle=False)),
                      val_evaluator=dict(type="Accuracy"), val_cfg=dict())
    kwargs.update(overrides)
    return Runner(**kwargs)


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers above, for test modules (which cannot import a conftest under importlib mode)."""
    return SimpleNamespace(make_runner=make_runner, DropoutNet=DropoutNet, samples=samples,
                           Recorder=Recorder, ScriptedScore=ScriptedScore)
