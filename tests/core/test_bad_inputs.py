"""The bad-input corpus: every bad input ends in one memfit error whose single line names the cause
(the config key, path or value) and the fix, and nothing already written is lost. Here: configs refused
before training and checkpoint files given to load or resume; failures while training and the command
line's errors are in tests/core/test_bad_inputs_training.py, the shared helpers in _bad_inputs_helpers.py.

Not repeated here (pinned elsewhere): tests/resume/test_resume_errors.py (pickle payload, missing /
truncated / corrupt checkpoint, a checkpoint of another model, optimizer or scheduler list, a weights
file given to resume, the CLI's resume error); tests/resume/test_load_from.py (weights whose keys do
not match, load_from dict typos); tests/core/test_runner.py (type='SDG', accumulative_count,
max_epoch, activation_checkpointin, LogerHook); tests/core/test_cli.py (trian_cfg, --cfg-options
type=SDG, a missing config file); tests/data/test_dataloader.py (build_dataloader on its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.checkpoint import read_latest
from memfit.errors import CheckpointError, ConfigError, MemfitError
from memfit.runner import Runner
from tests.core._bad_inputs_helpers import (
    SHAPES,
    VAL,
    Tiny,
    assert_nothing_lost,
    config,
    digest,
    hooks,
    loader,
    one_line,
    optim,
)


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A work dir holding a real checkpoint (epoch_1.pth, named by last_checkpoint)."""
    work_dir = tmp_path_factory.mktemp("previous")
    Runner.from_cfg(config(work_dir=str(work_dir),
                           default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1)))).train()
    assert read_latest(work_dir) == work_dir / "epoch_1.pth"
    return work_dir


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
    # torch scales gradients by max_norm / norm: 0 stops training, a negative max_norm flips every gradient
    ("clip max_norm negative", dict(optim_wrapper=dict(**optim(), clip_grad=dict(max_norm=-1))), ConfigError,
     ["optim_wrapper.clip_grad.max_norm=-1", "use a number above 0"]),
    ("clip max_norm a string", dict(optim_wrapper=dict(**optim(), clip_grad=dict(max_norm="1.0"))), ConfigError,
     ["optim_wrapper.clip_grad.max_norm='1.0'", "use a number above 0"]),
    ("clip norm_type 0", dict(optim_wrapper=dict(**optim(), clip_grad=dict(max_norm=1, norm_type=0))), ConfigError,
     ["optim_wrapper.clip_grad.norm_type=0", "'inf'"]),
    ("compile mode typo", dict(compile=dict(mode="max-autotun")), ConfigError,
     ["compile.mode='max-autotun'", "did you mean 'max-autotune'"]),
    ("compile backend typo", dict(compile=dict(backend="indcutor")), ConfigError,
     ["compile.backend='indcutor'", "did you mean 'inductor'"]),
    # switches that a truthy string or number would have turned on, or turned into something else
    ("optimizer_offload 'yes'", dict(optimizer_offload="yes"), ConfigError,
     ["optimizer_offload must be True or False, got str 'yes'"]),
    ("DDP zero=3", dict(strategy=dict(type="DDPStrategy", zero=3)), ConfigError,
     ["strategy.zero=3: DDPStrategy's zero is True (ZeRO-1", "for ZeRO-2/3 use FSDPStrategy"]),
    ("FSDP cpu_offload 'maybe'", dict(strategy=dict(type="FSDPStrategy", cpu_offload="maybe")), ConfigError,
     ["strategy.cpu_offload='maybe': use True or False"]),
    # an epoch-based loop over a sampler that never ends would never end an epoch
    ("InfiniteSampler by epoch", dict(train_dataloader=loader(sampler=dict(type="InfiniteSampler"))), ConfigError,
     ["train_dataloader.sampler: an InfiniteSampler never ends an epoch", "by_epoch=False"]),
    # a best checkpoint of a metric the validation does not return stopped the run at its first validation
    ("save_best not a metric", dict(**VAL, val_evaluator=dict(type="Accuracy", topk=(1, 2)),
                                    default_hooks=hooks(checkpoint=dict(type="CheckpointHook", save_best="acc"))),
     ConfigError, ["default_hooks.checkpoint.save_best='acc' is not a metric", "accuracy/top1, accuracy/top2"]),
    ("topk 0", dict(**VAL, val_evaluator=dict(type="Accuracy", topk=0)), ConfigError,
     ["val_evaluator: topk=0", "use a positive int"]),
    ("paramwise lr_mult negative",
     dict(optim_wrapper=dict(**optim(), paramwise_cfg=dict(custom_keys={"head": dict(lr_mult=-1)}))), ConfigError,
     ["paramwise_cfg.custom_keys['head'].lr_mult=-1", "use a number >= 0"]),
    ("drop_path_rate 1.5", dict(model=dict(type="TimmClassifier", model_name="resnet18", num_classes=4,
                                           drop_path_rate=1.5)), ConfigError,
     ["model.drop_path_rate=1.5", "a number in [0, 1]"]),
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
    ("checkpoint out_dir under a file",
     dict(default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1, out_dir="afile/ckpts"))),
     ConfigError, ["default_hooks.checkpoint.out_dir='afile/ckpts': cannot create", "afile: not a folder",
                   "set out_dir to a writable folder"]),
    # values that failed at the first step, inside torch, or were read as something else
    ("log_level typo", dict(log_level="DEBG"), ConfigError,
     ["log_level='DEBG': use one of DEBUG, INFO", "did you mean 'DEBUG'"]),
    ("checkpoint by_epoch a string",
     dict(default_hooks=hooks(checkpoint=dict(type="CheckpointHook", interval=1, by_epoch="no"))), ConfigError,
     ["default_hooks.checkpoint.by_epoch='no': use True or False"]),
    ("label_smoothing 1.5", dict(model=dict(type="TimmClassifier", model_name="resnet18", num_classes=4,
                                            label_smoothing=1.5)), ConfigError,
     ["model.label_smoothing=1.5: use a number in [0, 1]"]),
    ("timm num_classes 0", dict(model=dict(type="TimmClassifier", model_name="resnet18", num_classes=0)), ConfigError,
     ["model.num_classes=0: use the number of classes, an int >= 1"]),
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
    one_line(exc.value, "emptydir: a directory without a checkpoint", "a work dir holding last_checkpoint")
    with pytest.raises(CheckpointError) as exc:
        Runner.from_cfg(config(resume="emptydir")).train()
    one_line(exc.value, "emptydir: a directory without a checkpoint")


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
    one_line(exc.value, "empty.pth", "damaged (empty: 0 bytes)")
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
