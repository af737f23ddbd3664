"""The bad-input corpus (tests/core/test_bad_inputs.py), continued: failures while training (a full disk or an
interrupt during a save, a non-finite loss, an exception in the loop or in validation) and the command line's
errors. Each ends in one line naming where and why, and nothing already written is lost.
"""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.cli import main
from memfit.errors import CheckpointError, TrainingError, failure_summary
from memfit.hooks import Hook
from memfit.runner import Runner
from tests.core._bad_inputs_helpers import VAL, Tiny, assert_nothing_lost, config, digest, hooks, one_line


@pytest.fixture(autouse=True)
def _files(tmp_path):
    """In the test's directory: 'afile' (a regular file: paths under it cannot exist), 'emptydir'."""
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "emptydir").mkdir()


# ------------------------------------------------------------------ failures while training
@pytest.fixture
def trained(tmp_path) -> Path:
    """A fresh work dir with epoch_1.pth (2 iterations), to resume for a second epoch."""
    Runner.from_cfg(config(work_dir="run", default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1)))
                    ).train()
    return tmp_path / "run"


def second_epoch(**overrides: Any) -> Runner:
    hook = dict(type="CheckpointHook", interval=1)
    return Runner.from_cfg(config(work_dir="run", resume=True, train_cfg=dict(by_epoch=True, max_epochs=2),
                                  default_hooks=hooks(checkpoint=hook), **overrides))


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(trained, monkeypatch):
    sha = digest(trained / "epoch_1.pth")

    def full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    runner = second_epoch()
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as exc:
        runner.train()
    monkeypatch.undo()
    one_line(exc.value, str(trained / "epoch_2.pth"), "No space left on device", "free disk space")
    assert isinstance(exc.value.__cause__, OSError) and exc.value.__cause__.errno == errno.ENOSPC
    assert not (trained / "epoch_2.pth").exists()
    assert_nothing_lost(trained, sha=sha)


def test_interrupt_during_a_save_keeps_the_previous_checkpoint(trained, monkeypatch, caplog):
    sha = digest(trained / "epoch_1.pth")

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt

    runner = second_epoch()
    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.train()
    monkeypatch.undo()
    assert "training interrupted at the end of epoch 2" in caplog.text
    assert not (trained / "epoch_2.pth").exists()
    assert_nothing_lost(trained, sha=sha)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_loss_stops_naming_the_iteration(trained, bad):
    """The 2nd loss of the resumed run is iteration 4 (epoch 2); nothing is saved after it."""
    sha = digest(trained / "epoch_1.pth")
    with pytest.raises(TrainingError) as exc:
        second_epoch(model=dict(type=Tiny, bad_at=2, bad=bad)).train()
    one_line(exc.value, f"the loss is {bad} at epoch 2, iteration 4", "lower the learning rate",
             "action='skip'")
    assert failure_summary(exc.value).startswith("training failed at epoch 2, iteration 4: the loss is")
    assert not (trained / "epoch_2.pth").exists()
    assert_nothing_lost(trained, sha=sha)


def test_non_finite_loss_checked_every_few_iterations_still_names_it_and_saves_nothing_after(tmp_path):
    """interval=4 batches the checks (one sync per 4 iterations); the save after iteration 3 checks first."""
    cfg = config(model=dict(type=Tiny, bad_at=3), train_cfg=dict(by_epoch=False, max_iters=8),
                 default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1, by_epoch=False),
                                     check_invalid_loss=dict(interval=4)))
    with pytest.raises(TrainingError) as exc:
        Runner.from_cfg(cfg).train()
    one_line(exc.value, "the loss is nan at iteration 3")
    assert_nothing_lost(tmp_path / "w", "iter_2.pth")
    assert not (tmp_path / "w" / "iter_3.pth").exists()


class Snapshots(Hook):
    """The model's weights after every training iteration."""

    def __init__(self) -> None:
        self.weights: list[list[torch.Tensor]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.weights.append([p.detach().clone() for p in runner.model.parameters()])


def test_non_finite_loss_skip_counts_and_trains_on(caplog):
    snapshots = Snapshots()
    cfg = config(model=dict(type=Tiny, bad_at=3), train_cfg=dict(by_epoch=True, max_epochs=2),
                 default_hooks=hooks(check_invalid_loss=dict(action="skip", interval=1)), custom_hooks=[snapshots])
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert runner.optim_wrapper.nonfinite_losses == 1
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())
    assert "non-finite loss by iteration 3" in caplog.text and "1 non-finite losses so far" in caplog.text
    # Iteration 3 (the NaN loss) left the weights as they were; iteration 4, after it, stepped them again.
    w = snapshots.weights
    assert runner.iter == len(w) == 4 and runner.model.calls == 4
    assert all(torch.equal(a, b) for a, b in zip(w[2], w[1]))
    assert all(not torch.equal(a, b) for a, b in zip(w[3], w[2]))


def test_the_skip_count_survives_a_resume(tmp_path, caplog):
    """A checkpoint keeps the non-finite losses counted (and whether the open window skips its step): the
    resumed run counts on from it and does not report the first run's skip again."""
    skip = hooks(check_invalid_loss=dict(action="skip", interval=1), checkpoint=dict(type="CheckpointHook",
                                                                                     interval=1))
    Runner.from_cfg(config(model=dict(type=Tiny, bad_at=1), default_hooks=skip)).train()
    caplog.clear()
    runner = Runner.from_cfg(config(model=dict(type=Tiny, bad_at=2), default_hooks=skip, resume=True,
                                    train_cfg=dict(by_epoch=True, max_epochs=2)))
    runner.train()
    assert runner.optim_wrapper.nonfinite_losses == 2
    warnings = [r.getMessage() for r in caplog.records if "non-finite loss by" in r.getMessage()]
    assert warnings == ["non-finite loss by iteration 4: the optimizer step of its window was skipped "
                        "(2 non-finite losses so far)"]
    open_window = runner.optim_wrapper.checkpoint_state(with_optimizer=False)
    assert open_window["nonfinite"] == {"losses": 2, "window": False}
    runner.optim_wrapper._window_nonfinite = True
    state = runner.optim_wrapper.checkpoint_state(with_optimizer=False)
    runner.optim_wrapper.load_checkpoint_state({**state, "nonfinite": {"losses": 5, "window": True}})
    assert (runner.optim_wrapper.nonfinite_losses, runner.optim_wrapper._window_nonfinite) == (5, True)


class FailAt(Hook):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter + 1 == self.iteration:
            raise RuntimeError("boom in a hook")


def test_failure_in_the_loop_is_one_log_line_with_the_traceback_in_the_file(trained, capsys, caplog):
    sha = digest(trained / "epoch_1.pth")
    runner = second_epoch(custom_hooks=[FailAt(4)])
    with pytest.raises(RuntimeError) as exc:
        runner.train()
    assert type(exc.value) is RuntimeError and exc.value.args == ("boom in a hook",)  # propagates unchanged
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[0] == "training failed at epoch 2, iteration 4: RuntimeError: boom in a hook"
    assert failure_summary(exc.value) == errors[0]
    log_file = runner.log_dir / f"{runner.timestamp}.log"
    text = log_file.read_text()
    assert "training failed at epoch 2, iteration 4" in text and "Traceback (most recent call last)" in text
    assert "Traceback" not in capsys.readouterr().out
    assert_nothing_lost(trained, sha=sha)


class BrokenPredict(Tiny):
    def forward(self, img, label=None, mode="tensor", **_):
        if mode == "predict":
            raise ValueError("cannot predict")
        return super().forward(img, label, mode)


def test_failure_in_validation_names_it(capsys, caplog):
    runner = Runner.from_cfg(config(model=dict(type=BrokenPredict), **VAL, val_evaluator=dict(type="Accuracy")))
    with pytest.raises(ValueError, match="cannot predict"):
        runner.train()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["training failed in the validation after epoch 1: ValueError: cannot predict"]
    with pytest.raises(ValueError, match="cannot predict"):
        runner.val()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors[-1] == "val failed: ValueError: cannot predict"


# ------------------------------------------------------------------ the command line
CLI_CFG = """
model = dict(type='ImageClassifier', backbone=dict(type='torch.nn.Linear', in_features={features}, out_features=2))
train_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=8, image_size=16, num_classes=2))
val_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=4, image_size=16, num_classes=2))
val_evaluator = dict(type='Accuracy')
val_cfg = dict()
train_cfg = dict(by_epoch=True, max_epochs=1)
optim_wrapper = dict(optimizer=dict(type='SGD', lr={lr}))
default_hooks = dict(logger=dict(interval=100, tensorboard=False))
"""


def write_cfg(tmp_path: Path, features: int = 16, lr: float = 0.1) -> str:
    path = tmp_path / "cfg.py"
    path.write_text(textwrap.dedent(CLI_CFG.format(features=features, lr=lr)))
    return str(path)


def cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


def test_cli_config_error_names_the_config_file(tmp_path, capsys):
    cfg = write_cfg(tmp_path, lr=-1)
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "w")
    assert code == 2 and err == [
        f"memfit: error: {cfg}: optim_wrapper.optimizer.lr=-1: invalid learning rate: -1 (SGD)"]


def test_cli_config_path_is_a_directory(capsys):
    code, err, _ = cli(capsys, "train", "emptydir")
    assert code == 2 and len(err) == 1 and "'emptydir' is a directory" in err[0]


def test_cli_unwritable_work_dir_and_missing_checkpoint(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "afile/w")
    assert code == 2 and len(err) == 1 and "work_dir='afile/w': cannot create" in err[0]
    code, err, _ = cli(capsys, "eval", cfg, "--work-dir", "w", "--checkpoint", "nope.pth")
    assert code == 2 and err == ["memfit: error: checkpoint nope.pth does not exist"]


def test_cli_failure_during_training_exits_1_with_one_line(tmp_path, capsys):
    cfg = write_cfg(tmp_path, features=10)  # Linear(10, 2) over 16-pixel rows: the forward fails
    code, err, out = cli(capsys, "train", cfg, "--work-dir", "w")
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("memfit: error: training failed at epoch 1, iteration 1: RuntimeError: mat1 and mat2 "
                             "shapes cannot be multiplied")
    log_file = next(Path("w").glob("*/*.log"))
    assert f"traceback in {log_file.resolve()}" in err[0]
    assert "Traceback (most recent call last)" in log_file.read_text() and "Traceback" not in out


def test_cli_debug_prints_the_traceback(tmp_path, capsys):
    cfg = write_cfg(tmp_path, features=10)
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "w", "--debug")
    assert code == 1 and err[0] == "Traceback (most recent call last):"
    assert err[-1].startswith("memfit: error: training failed at epoch 1, iteration 1: RuntimeError")
