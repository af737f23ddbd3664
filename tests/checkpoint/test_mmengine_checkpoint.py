"""A run brought from MMEngine: its config trains identically and its checkpoints load and resume.

tests/fixtures/mmengine/ holds what MMEngine 0.10.7 itself wrote (make_fixture.py): a 4-epoch run of
a tiny model with paramwise_cfg (six param groups in MMEngine, three merged ones in memfit) and two
chained schedulers, its checkpoint after epoch 2 (with MMEngine's message hub, numpy inside), every
iteration's learning rates and the final weights.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.checkpoint import load_checkpoint
from memfit.errors import CheckpointError
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mmengine"
REF = json.loads((FIXTURE / "reference.json").read_text())
# MMEngine's param groups, one per parameter in named_parameters() order.
MM_ORDER = ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias"]


class Net(BaseModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, inputs, target, mode="tensor"):
        out = self.fc2(self.norm(self.fc1(inputs)))
        return {"loss": ((out - target) ** 2).mean()} if mode == "loss" else out


def _dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g)
    return [dict(inputs=x[i], target=x[i].sum(0, keepdim=True)) for i in range(8)]


class RecordLR(Hook):
    """Each iteration's ``get_lr()``, as make_fixture.py records MMEngine's: one lr per MMEngine group
    (per parameter, MM_ORDER) though memfit's optimizer merges them, then ``base_lr``."""

    def __init__(self):
        self.lrs = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        assert len(runner.optim_wrapper.optimizer.param_groups) == 3  # merged: fc weights, biases, norm
        lrs = runner.optim_wrapper.get_lr()
        self.lrs.append(lrs["lr"] + lrs["base_lr"])


def _runner(tmp_path, **kw):
    cfg = REF["cfg"]
    return Runner(
        model=Net(), work_dir=str(tmp_path),
        train_dataloader=dict(dataset=_dataset(), batch_size=2, sampler=dict(type="DefaultSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=cfg["optim_wrapper"], param_scheduler=cfg["param_scheduler"], train_cfg=cfg["train_cfg"],
        default_hooks=dict(checkpoint=None), randomness=dict(seed=0), **kw)


def _expected_lrs(start=0):
    return [ref["lr"] + ref["base_lr"] for ref in REF["lrs"][start:]]


def _assert_weights(model):
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(REF["weights"][name]), rtol=1e-5, atol=1e-6)


def test_mmengine_config_trains_identically(tmp_path):
    runner = _runner(tmp_path)
    record = RecordLR()
    runner.register_hook(record)
    runner.train()
    assert len(record.lrs) == 16
    for got, want in zip(record.lrs, _expected_lrs()):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    _assert_weights(runner.model)


def test_resume_from_an_mmengine_checkpoint_continues_identically(tmp_path, caplog):
    runner = _runner(tmp_path, resume=str(FIXTURE / "epoch_2.pth"))
    record = RecordLR()
    runner.register_hook(record)
    runner.train()
    assert runner.iter == 16 and len(record.lrs) == 8  # epochs 3 and 4 only
    for got, want in zip(record.lrs, _expected_lrs(start=8)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    _assert_weights(runner.model)  # Adam's moments came back mapped onto memfit's merged groups


def test_load_from_an_mmengine_checkpoint_loads_the_weights(tmp_path):
    saved = load_checkpoint(FIXTURE / "epoch_2.pth")
    assert saved["meta"]["epoch"] == 2 and "message_hub" in saved  # its HistoryBuffers read as inert placeholders
    runner = _runner(tmp_path, load_from=str(FIXTURE / "epoch_2.pth"))
    runner.train_cfg = None
    runner.load_weights(str(FIXTURE / "epoch_2.pth"))
    for name, value in runner.model.state_dict().items():
        assert torch.equal(value, saved["state_dict"][name])


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _mmengine_class(monkeypatch, qualified: str) -> type:
    """A stand-in class pickled under one of MMEngine's names (the test process has no MMEngine)."""
    import sys
    import types

    module_name, name = qualified.rsplit(".", 1)
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    cls = type(name, (), {"__module__": module_name})
    setattr(sys.modules[module_name], name, cls)
    return cls


def _forget_mmengine(monkeypatch):
    import sys

    for name in [n for n in sys.modules if n == "mmengine" or n.startswith("mmengine.")]:
        monkeypatch.delitem(sys.modules, name)


def test_only_mmengine_and_numpy_objects_are_read_as_placeholders(tmp_path, monkeypatch):
    buffer = _mmengine_class(monkeypatch, "mmengine.logging.history_buffer.HistoryBuffer")
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {"w": torch.ones(1)}, "message_hub": {"a": buffer()}}, tmp_path / "ok.pth")
    torch.save({"state_dict": {"w": torch.ones(1)}, "message_hub": {"a": buffer(), "b": _Hostile(marker)}},
               tmp_path / "mixed.pth")
    _forget_mmengine(monkeypatch)
    assert repr(load_checkpoint(tmp_path / "ok.pth")["message_hub"]["a"]) == \
        "<unread mmengine.logging.history_buffer.HistoryBuffer>"
    with pytest.raises(CheckpointError, match="refuses to unpickle object 'os.system'"):
        load_checkpoint(tmp_path / "mixed.pth")
    assert not marker.exists()


def test_resume_refuses_what_needs_mmengine_code(tmp_path, monkeypatch):
    # A scheduler state holding one of MMEngine's objects (OneCycleLR keeps its anneal function).
    anneal = _mmengine_class(monkeypatch, "mmengine.optim.scheduler.param_scheduler.AnnealFunc")
    saved = load_checkpoint(FIXTURE / "epoch_2.pth")
    del saved["message_hub"]
    saved["param_schedulers"][0]["anneal_func"] = anneal()
    torch.save(saved, tmp_path / "odd.pth")
    _forget_mmengine(monkeypatch)
    with pytest.raises(CheckpointError, match=r"param_schedulers holds an object of mmengine\.optim\.scheduler"):
        _runner(tmp_path / "w", resume=str(tmp_path / "odd.pth")).train()
