"""The bad-input corpus: every bad input ends in one memfit error whose single line names the cause
(the config key, path or value) and the fix, and nothing already written is lost.

Not repeated here (pinned elsewhere): tests/resume/test_resume_errors.py (pickle payload, missing /
truncated / corrupt checkpoint, a checkpoint of another model, optimizer or scheduler list, a weights
file given to resume, the CLI's resume error); tests/resume/test_load_from.py (weights whose keys do
not match, load_from dict typos); tests/core/test_runner.py (type='SDG', accumulative_count,
max_epoch, activation_checkpointin, LogerHook); tests/core/test_cli.py (trian_cfg, --cfg-options
type=SDG, a missing config file); tests/data/test_dataloader.py (build_dataloader on its own).
"""

from __future__ import annotations

import errno
import hashlib
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.checkpoint import load_checkpoint, read_latest
from memfit.cli import main
from memfit.errors import CheckpointError, ConfigError, MemfitError, TrainingError, failure_summary
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner

SHAPES = dict(type="ShapesDataset", num_samples=8, image_size=16, num_classes=2)
QUIET = dict(checkpoint=None, logger=dict(interval=100, tensorboard=False))


class Tiny(BaseModel):
    """Linear classifier over 16x16 shapes; the ``bad_at``-th loss of this run is multiplied by ``bad``."""

    def __init__(self, width: int = 4, bad_at: int | None = None, bad: float = float("nan")) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, width)
        self.head = nn.Linear(width, 2)
        self.bad_at, self.bad, self.calls = bad_at, bad, 0

    def forward(self, img, label=None, mode="tensor", **_):
        out = self.head(self.fc(img.flatten(1)).relu())
        if mode == "loss":
            self.calls += 1
            loss = F.cross_entropy(out, label)
            return {"loss": loss * self.bad if self.calls == self.bad_at else loss}
        if mode == "predict":
            return out.softmax(-1), label
        return out


def hooks(**entries: Any) -> dict:
    """default_hooks: quiet ones (no checkpoints, no TensorBoard) with ``entries`` on top."""
    return {**QUIET, **entries}


def config(**overrides: Any) -> dict:
    """A config that trains Tiny for one epoch of 2 iterations; ``overrides`` replace top-level keys."""
    cfg = dict(
        model=dict(type=Tiny),
        work_dir="w",
        train_dataloader=dict(batch_size=4, dataset=SHAPES),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=hooks(),
        randomness=dict(seed=0),
    )
    cfg.update(overrides)
    return cfg


def loader(**kw: Any) -> dict:
    """A train/val dataloader config over 8 shapes, batch 4; ``kw`` replace or add keys."""
    return {"batch_size": 4, "dataset": SHAPES, **kw}


def optim(**kw: Any) -> dict:
    return dict(optimizer=dict(type="SGD", lr=0.1, **kw))


VAL = dict(val_dataloader=loader(), val_cfg=dict())


def one_line(exc: BaseException, *needles: str) -> str:
    """The message is one line and holds every needle (the key/path/value and the fix)."""
    msg = str(exc)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A work dir holding a real checkpoint (epoch_1.pth, named by last_checkpoint)."""
    work_dir = tmp_path_factory.mktemp("previous")
    Runner.from_cfg(config(work_dir=str(work_dir),
                           default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1)))).train()
    assert read_latest(work_dir) == work_dir / "epoch_1.pth"
    return work_dir


def assert_nothing_lost(work_dir: Path, name: str = "epoch_1.pth", sha: str | None = None) -> None:
    """last_checkpoint still names ``name``, which loads (unchanged), and no temporary file is left."""
    assert read_latest(work_dir) == work_dir / name
    assert load_checkpoint(work_dir / name)["meta"]["memfit_version"]
    if sha is not None:
        assert digest(work_dir / name) == sha
    assert not [p.name for p in work_dir.iterdir() if ".tmp-" in p.name]


@pytest.fixture(autouse=True)
def _files(tmp_path):
    """In the test's directory: 'afile' (a regular file: paths under it cannot exist), 'emptydir'."""
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "emptydir").mkdir()


# ------------------------------------------------------------------ configs refused before training
# (id, overrides, exception type, needles: the key/value and the fix)
CASES = [
    # typos at every level
    ("top-level typo", dict(optim_wraper=optim()), ConfigError,
     ["'optim_wraper'", "did you mean 'optim_wrapper'"]),
    ("train_cfg typo", dict(train_cfg=dict(max_epochs=1, val_interal=1)), ConfigError,
     ["train_cfg.val_interal", "did you mean 'val_interval'"]),
    ("optim_wrapper typo", dict(optim_wrapper=dict(**optim(), clip_gard=dict(max_norm=1))), ConfigError,
     ["optim_wrapper: unknown key 'clip_gard'", "did you mean 'clip_grad'"]),
    ("optimizer kwarg typo", dict(optim_wrapper=optim(momentun=0.9)), ConfigError,
     ["optim_wrapper.optimizer: unknown key 'momentun'", "did you mean 'momentum'"]),
    ("scheduler kwarg typo", dict(param_scheduler=[dict(type="StepLR", step_sise=1)]), ConfigError,
     ["param_scheduler[0]: unknown key 'step_sise'", "did you mean 'step_size'"]),
    ("scheduler type typo", dict(param_scheduler=[dict(type="StepLR", step_size=1), dict(type="CosineLR")]),
     ConfigError, ["param_scheduler[1]: unknown param_scheduler type 'CosineLR'", "did you mean"]),
    ("dataloader typo", dict(train_dataloader=dict(batch_sise=4, dataset=SHAPES)), ConfigError,
     ["train_dataloader.batch_sise", "did you mean 'batch_size'"]),
    ("dataset kwarg typo", dict(train_dataloader=loader(dataset=dict(SHAPES, imagesize=16))),
     ConfigError, ["train_dataloader.dataset: unknown key 'imagesize'", "did you mean 'image_size'"]),
    ("dataset type typo", dict(train_dataloader=dict(batch_size=4, dataset=dict(type="ShapeDataset"))),
     ConfigError, ["train_dataloader.dataset: unknown dataset type 'ShapeDataset'", "did you mean 'ShapesDataset'"]),
    ("sampler kwarg typo", dict(train_dataloader=loader(sampler=dict(type="DefaultSampler", shufle=True))),
     ConfigError, ["train_dataloader.sampler: unknown key 'shufle'", "did you mean 'shuffle'"]),
    ("sampler type typo", dict(train_dataloader=loader(sampler=dict(type="DefaultSample"))), ConfigError,
     ["train_dataloader.sampler: unknown sampler type 'DefaultSample'", "did you mean 'DefaultSampler'"]),
    ("collate_fn typo", dict(train_dataloader=loader(collate_fn=dict(type="default_colate"))), ConfigError,
     ["train_dataloader.collate_fn: unknown collate_fn type 'default_colate'", "did you mean 'default_collate'"]),
    ("custom hook kwarg typo", dict(custom_hooks=[dict(type="IterTimerHook"), dict(type="CheckpointHook", intervl=1)]),
     ConfigError,
     ["custom_hooks[1]: unknown key 'intervl'", "did you mean 'interval'"]),
    ("default_hooks name typo", dict(default_hooks=hooks(loger=dict(interval=1))), ConfigError,
     ["default_hooks.loger", "did you mean 'logger'"]),
    ("default hook kwarg typo", dict(default_hooks=hooks(logger=dict(intervall=5))), ConfigError,
     ["default_hooks.logger: unknown key 'intervall'", "did you mean 'interval'"]),
    ("val_evaluator type typo", dict(**VAL, val_evaluator=dict(type="Acuracy")), ConfigError,
     ["val_evaluator: unknown metric type 'Acuracy'", "did you mean 'Accuracy'"]),
    ("val_evaluator kwarg typo", dict(**VAL, val_evaluator=[dict(type="Accuracy"), dict(type="Accuracy", top_k=1)]),
     ConfigError, ["val_evaluator[1]: unknown key 'top_k'", "did you mean 'topk'"]),
    ("model kwarg typo", dict(model=dict(type=Tiny, widht=8)), ConfigError,
     ["model: unknown key 'widht'", "did you mean 'width'"]),
    ("strategy name typo", dict(strategy="dpp"), ConfigError, ["unknown strategy 'dpp'", "did you mean 'ddp'"]),
    ("strategy kwarg typo", dict(strategy=dict(type="DDPStrategy", find_unused=True)), ConfigError,
     ["strategy: DDPStrategy: unknown key 'find_unused'", "did you mean 'find_unused_parameters'"]),
    ("env_cfg typo", dict(env_cfg=dict(cudnn_bench=True)), ConfigError,
     ["env_cfg.cudnn_bench", "did you mean 'cudnn_benchmark'"]),
    ("randomness typo", dict(randomness=dict(sed=0)), ConfigError, ["randomness.sed", "did you mean 'seed'"]),
    # wrong types
    ("batch_size a string", dict(train_dataloader=dict(batch_size="4", dataset=SHAPES)), ConfigError,
     ["train_dataloader.batch_size must be int", "'4'"]),
    ("lr a YAML string", dict(optim_wrapper=dict(optimizer=dict(type="SGD", lr="1e-3"))), ConfigError,
     ["optim_wrapper.optimizer.lr='1e-3' is a string", "write the number 0.001"]),
    ("max_epochs a string", dict(train_cfg=dict(by_epoch=True, max_epochs="2")), ConfigError,
     ["train_cfg.max_epochs must be int", "'2'"]),
    ("train_cfg a list", dict(train_cfg=[dict(max_epochs=1)]), ConfigError, ["train_cfg must be a dict", "list"]),
    ("optim_wrapper a list", dict(optim_wrapper=[optim()]), ConfigError,
     ["optim_wrapper must be a dict or an OptimWrapper", "list"]),
    ("param_scheduler entry a string", dict(param_scheduler=["StepLR"]), ConfigError,
     ["param_scheduler[0]: expected a dict with 'type'", "str"]),
    ("custom hook an int", dict(custom_hooks=[3]), ConfigError,
     ["custom_hooks[0]: a hook must subclass memfit.hooks.Hook", "int"]),
    ("model without its required argument", dict(model=dict(type="ImageClassifier")), ConfigError,
     ["model: ImageClassifier needs 'backbone'", "add model.backbone=..."]),
    # zero / negative sizes and rates
    ("batch_size 0", dict(train_dataloader=dict(batch_size=0, dataset=SHAPES)), ConfigError,
     ["train_dataloader.batch_size must be >= 1", "got 0"]),
    ("num_workers -1", dict(train_dataloader=loader(num_workers=-1)), ConfigError,
     ["train_dataloader.num_workers must be >= 0", "got -1"]),
    ("lr -1", dict(optim_wrapper=dict(optimizer=dict(type="SGD", lr=-1))), ConfigError,
     ["optim_wrapper.optimizer.lr=-1: invalid learning rate: -1 (SGD)"]),
    ("momentum negative", dict(optim_wrapper=optim(momentum=-0.5)), ConfigError,
     ["optim_wrapper.optimizer.momentum=-0.5: invalid momentum value: -0.5 (SGD)"]),
    ("lr -1 with optimizer_in_backward", dict(optim_wrapper=dict(optimizer=dict(type="SGD", lr=-1)),
                                              cfg=dict(optimizer_in_backward=True)), ConfigError,
     ["optim_wrapper.optimizer.lr=-1: invalid learning rate: -1 (SGD)"]),
    ("scheduler milestones an int", dict(param_scheduler=[dict(type="MultiStepLR", milestones=3)]), ConfigError,
     ["param_scheduler[0]: 'int' object is not iterable (MultiStepLR)"]),
    ("max_epochs 0", dict(train_cfg=dict(by_epoch=True, max_epochs=0)), ConfigError,
     ["train_cfg.max_epochs must be >= 1", "got 0"]),
    ("max_iters negative", dict(train_cfg=dict(by_epoch=False, max_iters=-5)), ConfigError,
     ["train_cfg.max_iters must be >= 1", "got -5"]),
    ("accumulative_counts 0", dict(optim_wrapper=dict(**optim(), accumulative_counts=0)), ConfigError,
     ["optim_wrapper.accumulative_counts=0", "use an int >= 1"]),
    ("logger interval 0", dict(default_hooks=hooks(logger=dict(interval=0))), ConfigError,
     ["default_hooks.logger: interval=0", "use an int >= 1"]),
    ("checkpoint interval 0", dict(default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=0))),
     ConfigError, ["default_hooks.checkpoint: interval=0", "use an int >= 1, or -1"]),
    ("invalid-loss action", dict(default_hooks=hooks(check_invalid_loss=dict(action="ignore"))), ConfigError,
     ["default_hooks.check_invalid_loss: action='ignore'", "use 'stop'"]),
    ("scheduler begin negative", dict(param_scheduler=dict(type="StepLR", step_size=1, begin=-1)), ConfigError,
     ["param_scheduler.begin=-1", "use an int >= 0"]),
    ("scheduler end before begin", dict(param_scheduler=[dict(type="StepLR", step_size=1, begin=1, end=1)]),
     ConfigError, ["param_scheduler[0]: end=1 is not after begin=1"]),
    ("scheduler bad factor", dict(param_scheduler=[dict(type="LinearLR", start_factor=2.0)]), ConfigError,
     ["param_scheduler[0]: starting multiplicative factor", "(LinearLR)"]),
    ("topk 0", dict(**VAL, val_evaluator=dict(type="Accuracy", topk=0)), ConfigError,
     ["val_evaluator: topk=0", "use a positive int"]),
    ("model negative width", dict(model=dict(type=Tiny, width=-3)), ConfigError,
     ["model: ", "negative dimension -3", "(Tiny)"]),
    ("image_size too small", dict(train_dataloader=dict(batch_size=4, dataset=dict(SHAPES, image_size=4))),
     ConfigError, ["train_dataloader.dataset: ShapesDataset: image_size=4", "use >= 8"]),
    # data that gives no batch
    ("empty dataset", dict(train_dataloader=dict(batch_size=4, dataset=dict(SHAPES, num_samples=0))), ConfigError,
     ["train_dataloader.dataset is empty", "num_samples"]),
    ("empty val dataset", dict(val_dataloader=loader(dataset=dict(SHAPES, num_samples=0)), val_cfg=dict(),
                               val_evaluator=dict(type="Accuracy")), ConfigError,
     ["val_dataloader.dataset is empty"]),
    ("batch larger than the dataset with drop_last", dict(train_dataloader=loader(batch_size=16, drop_last=True)),
     ConfigError, ["train_dataloader: batch_size=16 with drop_last=True leaves no batch", "8 samples",
                   "lower batch_size or set drop_last=False"]),
    # missing and unusable paths
    ("ImageFolder root missing", dict(train_dataloader=loader(dataset=dict(type="ImageFolder", root="nope"))),
     ConfigError, ["train_dataloader.dataset: ImageFolder: root='nope' is not a folder", "point dataset.root"]),
    ("ImageFolder root under a file",
     dict(train_dataloader=loader(dataset=dict(type="ImageFolder", root="afile/images"))), ConfigError,
     ["root='afile/images' is not a folder"]),
    ("ImageFolder root without class folders",
     dict(train_dataloader=loader(dataset=dict(type="ImageFolder", root="emptydir"))), ConfigError,
     ["train_dataloader.dataset: ImageFolder: root='emptydir'", "class folder", "Put the images in"]),
    ("work_dir under a file", dict(work_dir="afile/run"), ConfigError,
     ["work_dir='afile/run': cannot create", "Not a directory", "writable folder"]),
]


@pytest.mark.parametrize(("overrides", "kind", "needles"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_config_is_one_line_and_loses_nothing(previous, overrides, kind, needles):
    """Each config, pointed at a work dir that holds a checkpoint (resume=True), is refused before
    training with one line; the checkpoint is untouched and still loads."""
    sha = digest(previous / "epoch_1.pth")
    cfg = config(work_dir=str(previous), resume=True)
    cfg.update(overrides)
    with pytest.raises(kind) as exc:
        Runner.from_cfg(cfg).train()
    assert isinstance(exc.value, MemfitError)
    one_line(exc.value, *needles)
    assert_nothing_lost(previous, sha=sha)


def test_constructor_error_keeps_the_original_as_cause():
    with pytest.raises(ConfigError) as exc:
        Runner.from_cfg(config(optim_wrapper=dict(optimizer=dict(type="SGD", lr=-1)))).train()
    assert str(exc.value) == "optim_wrapper.optimizer.lr=-1: invalid learning rate: -1 (SGD)"
    assert isinstance(exc.value.__cause__, ValueError)


# ------------------------------------------------------------------ checkpoint files given to load or resume
def test_load_from_missing_and_under_a_file():
    for path in ("nope.pth", "afile/epoch_1.pth"):
        with pytest.raises(CheckpointError) as exc:
            Runner.from_cfg(config(load_from=path)).train()
        one_line(exc.value, path, "does not exist")


def test_directories_where_a_checkpoint_file_is_expected():
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(load_from="emptydir")).train()
    one_line(exc.value, "emptydir is a directory, not a checkpoint file")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(resume="emptydir")).train()
    one_line(exc.value, "emptydir", "not written by memfit")


def test_foreign_checkpoints(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(load_from="list.pth")).train()
    one_line(exc.value, "list.pth holds a list, not a dict", "torch.save(model.state_dict(), path)")
    torch.save(torch.ones(3), tmp_path / "tensor.pth")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(resume="tensor.pth")).train()
    one_line(exc.value, "tensor.pth holds a Tensor, not a dict")


def test_empty_checkpoint_file_and_corrupt_latest(tmp_path):
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(resume="empty.pth")).train()
    one_line(exc.value, "empty.pth", "empty or truncated")
    # resume=True where last_checkpoint names a damaged file: the error names that file
    work = tmp_path / "damaged"
    work.mkdir()
    (work / "epoch_3.pth").write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    (work / "last_checkpoint").write_text("epoch_3.pth")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(work_dir=str(work), resume=True)).train()
    one_line(exc.value, str(work / "epoch_3.pth"), "truncated or corrupt")


def test_load_from_a_checkpoint_of_another_model(previous):
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(model=dict(type=Tiny, width=8), load_from=str(previous / "epoch_1.pth"))).train()
    one_line(exc.value, "epoch_1.pth", "shape mismatch at 'fc.weight'", "(4, 768) vs model (8, 768)")
    assert_nothing_lost(previous)


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
    assert code == 2 and err == [f"memfit: error: {cfg}: optim_wrapper.optimizer.lr=-1: invalid learning rate: -1 (SGD)"]


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
