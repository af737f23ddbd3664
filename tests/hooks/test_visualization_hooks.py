"""The visualization hooks MMEngine's codebases put in their configs: MMDetection's default_runtime.py (with
DetVisualizationHook) builds and trains, a hook asked to draw says once that memfit draws no images, and an
argument none of them takes is refused before training."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn

from memfit import errors
from memfit.config import Config
from memfit.errors import ConfigError
from memfit.hooks.visualization import DetVisualizationHook
from memfit.model import BaseModel
from memfit.runner import Runner
from tests.config._mmdetection_files import FILES


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(errors, "_WARNED", set())


class Regression(BaseModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y, mode="tensor"):
        out = self.fc(x)
        return {"loss": (out - y).pow(2).mean()} if mode == "loss" else (out, y)


def _runner(tmp_path, default_hooks: dict) -> Runner:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return Runner(model=Regression(), work_dir=str(tmp_path), randomness=dict(seed=0), default_hooks=default_hooks,
                  train_dataloader=dict(batch_size=4, dataset=[(x[i], x[i].sum(0, keepdim=True)) for i in range(8)],
                                        sampler=dict(type="DefaultSampler", shuffle=False)),
                  train_cfg=dict(by_epoch=True, max_epochs=1), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)))


def _warnings(caplog) -> list[str]:
    records = {id(r): r for r in caplog.records}.values()
    return [r.getMessage() for r in records if r.name == "memfit" and "has no effect" in r.getMessage()]


def test_mmdetections_default_hooks_build_and_train_without_a_warning(tmp_path, caplog):
    runtime = tmp_path / "default_runtime.py"
    runtime.write_text(textwrap.dedent(FILES["_base_/default_runtime.py"]))
    runner = _runner(tmp_path, Config.fromfile(runtime).to_dict()["default_hooks"])
    assert any(isinstance(h, DetVisualizationHook) for h in runner._hooks)
    runner.train()
    assert (tmp_path / "epoch_1.pth").is_file()
    assert _warnings(caplog) == []


@pytest.mark.parametrize(("hook", "warned"), [
    (dict(type="DetVisualizationHook", draw=True, interval=5), "DetVisualizationHook(draw=True)"),
    (dict(type="SegVisualizationHook", draw=True), "SegVisualizationHook(draw=True)"),
    (dict(type="VisualizationHook", enable=True), "VisualizationHook(enable=True)"),
    (dict(type="DetVisualizationHook", test_out_dir="vis"), "DetVisualizationHook(test_out_dir='vis')"),
    (dict(type="NaiveVisualizationHook"), "NaiveVisualizationHook"),
])
def test_a_hook_asked_to_draw_says_once_that_memfit_draws_no_images(tmp_path, caplog, hook, warned):
    _runner(tmp_path, dict(visualization=hook))
    _runner(tmp_path, dict(visualization=hook))
    assert _warnings(caplog) == [f"{warned} has no effect in memfit: memfit draws no images (validation metrics "
                                 "and scalars are logged as usual)"]


def test_an_argument_no_visualization_hook_takes_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"default_hooks\.visualization: unknown key 'drwa': did you mean 'draw'\?"):
        _runner(tmp_path, dict(visualization=dict(type="DetVisualizationHook", drwa=True)))
