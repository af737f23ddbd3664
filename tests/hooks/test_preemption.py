"""PreemptionHook: a SIGTERM/SIGUSR1 mid-run saves at the end of that iteration on every rank, stops with
Preempted (exit status 75 from the CLI), and the resumed run continues bit for bit."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit.hooks.preemption
from memfit.checkpoint import load_checkpoint, read_latest
from memfit.cli import main
from memfit.errors import PREEMPTED_EXIT_CODE, Preempted
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner
from memfit.testing import SignalAt, launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "preemption_run.py"


class DropoutNet(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2)

    def forward(self, x, y, mode="tensor"):
        logits = self.head(self.drop(self.fc(x).relu()))
        return {"loss": F.cross_entropy(logits, y)} if mode == "loss" else logits


class Losses(Hook):
    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.rows.append((runner.iter, outputs["loss"].item()))


def samples(n: int = 32) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [(x[i], (x[i, 0] > 0).long()) for i in range(n)]


def make_runner(work_dir: Path, hooks: list, **overrides) -> Runner:
    """2 epochs of 8 iterations, dropout, accumulation over 3 micro-steps, a per-iteration schedule."""
    kwargs = dict(
        model=dict(type=DropoutNet), work_dir=str(work_dir), custom_hooks=hooks, randomness=dict(seed=0),
        train_dataloader=dict(batch_size=4, dataset=samples(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9), accumulative_counts=3),
        param_scheduler=dict(type="LinearLR", start_factor=0.5, by_epoch=False, end=12),
        default_hooks=dict(checkpoint=dict(interval=1, by_epoch=True), logger=dict(interval=100)),
    )
    return Runner(**{**kwargs, **overrides})


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_saves_stops_and_resumes_exactly(tmp_path, sig):
    full = Losses()
    full_model = make_runner(tmp_path / "full", [full]).train()

    def sentinel(signum, frame):  # the handler a user had before train()
        raise AssertionError("memfit's handler should have caught it")

    previous = signal.signal(getattr(signal, sig), sentinel)
    try:
        first = Losses()
        with pytest.raises(Preempted) as info:
            make_runner(tmp_path / "run", [first, SignalAt(at=5, signal=sig)]).train()
        assert signal.getsignal(getattr(signal, sig)) is sentinel  # put back after train()
    finally:
        signal.signal(getattr(signal, sig), previous)
    ckpt = tmp_path / "run" / "iter_5.pth"
    assert info.value.signal_name == sig and info.value.iteration == 5 and info.value.checkpoint == str(ckpt)
    assert read_latest(tmp_path / "run") == ckpt
    state = load_checkpoint(ckpt)
    assert state["loop"] == {"epoch": 0, "iter": 5, "batch_in_epoch": 5} and "grads" in state  # window open
    assert first.rows == full.rows[:5]

    second = Losses()
    resumed_model = make_runner(tmp_path / "run", [second], resume=True).train()
    assert first.rows + second.rows == full.rows
    for (name, a), b in zip(full_model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_default_hook_is_turned_off_by_none(tmp_path):
    runner = make_runner(tmp_path / "off", [], default_hooks=dict(checkpoint=None, preemption=None))
    assert not any(type(h).__name__ == "PreemptionHook" for h in runner.hooks)
    assert any(type(h).__name__ == "PreemptionHook" for h in make_runner(tmp_path / "on", []).hooks)


def test_second_sigterm_goes_to_the_previous_handler(tmp_path, monkeypatch):
    monkeypatch.setattr(memfit.hooks.preemption, "_REPEAT_S", 0.0)  # not a duplicate of the first
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with pytest.raises(Preempted):
            make_runner(tmp_path / "run", [SignalAt(at=2, times=2)]).train()
        assert calls == [signal.SIGTERM]  # the second one: the process would have died here
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cli_prints_one_line_and_exits_75(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "tiny.py"
    cfg.write_text(
        "train_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', image_size=16, num_classes=2, "
        "num_samples=16))\n"
        "model = dict(type='TimmClassifier', model_name='resnet10t', num_classes=2)\n"
        "train_cfg = dict(by_epoch=True, max_epochs=1)\n"
        "optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01))\n"
        "default_hooks = dict(logger=dict(interval=100))\n"
        "custom_hooks = [dict(type='memfit.testing.SignalAt', at=2, signal='SIGUSR1')]\n"
        "randomness = dict(seed=0)\n")
    assert main(["train", str(cfg), "--work-dir", "wd"]) == PREEMPTED_EXIT_CODE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: preempted: SIGUSR1 received; stopped after iteration 2 "
                                               "(epoch 1) and saved "), err
    assert "--resume" in err[0] and err[0].endswith(f"(exit status {PREEMPTED_EXIT_CODE})")
    assert read_latest(tmp_path / "wd").name == "iter_2.pth"
    rc = main(["train", str(cfg), "--work-dir", "wd", "--resume", "--cfg-options", "custom_hooks=[]"])
    assert rc == 0 and read_latest(tmp_path / "wd").name == "epoch_1.pth"


def test_two_ranks_stop_together_when_one_is_signalled(tmp_path):
    """DDP, and FSDP saving in the background (finalized before Preempted), in one launch."""
    proc = launch(SCRIPT, 2, [str(tmp_path), "ddp", "fsdp_async"], out_dir=tmp_path / "out", timeout=180)
    results = read_results(tmp_path / "out", 2, proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for strategy in ("ddp", "fsdp_async"):
        for r in (result[strategy] for result in results):
            assert r["preempted"] == dict(signal="SIGTERM", iteration=5, ranks="on rank 1", saved=True), strategy
            assert r["first"] == r["full"][:5] and r["first"] + r["resumed"] == r["full"], strategy
            assert r["weights_equal"], strategy


@pytest.mark.parametrize("touched, expected", [(True, PREEMPTED_EXIT_CODE), (False, 1)])
def test_gpus_launch_reports_a_preempted_child(monkeypatch, touched, expected):
    """``memfit train --gpus N``: torchrun exits 1 when a child exits non-zero; a preempted child says so."""
    import sys

    import memfit.launch

    child = "import os, pathlib, sys; " + ("pathlib.Path(os.environ['MEMFIT_PREEMPTED_FILE']).touch(); " if touched
                                           else "") + "sys.exit(1)"
    monkeypatch.setattr(memfit.launch, "torchrun_command", lambda *args, **kwargs: [sys.executable, "-c", child])
    assert memfit.launch.spawn(["train", "cfg.py", "--gpus", "2"], 2) == expected
