"""Each seed snippet, completed into configs/vissl/*.yaml, trains with `memfit train`, doing what VISSL's
key asks; `memfit convert` prints a Python config that loads to the same config and trains the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from memfit import cli
from memfit.config import Config
from memfit.config.vissl import check_schedule, schedule_value
from memfit.data import DefaultSampler
from memfit.hooks import Hook
from memfit.memory.wrapping import wrapped_forward
from memfit.optim.larc import Larc
from memfit.runner import Runner

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "vissl"
FROM_CFG = Runner.from_cfg.__func__  # unpatched


class Recorder(Hook):
    """lr and loss of every training iteration."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        self.lrs.append(runner.optim_wrapper.param_groups[0]["lr"])

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.losses.append(outputs["loss"].item())


@pytest.fixture
def train(monkeypatch, tmp_path):
    """``train(config)``: `memfit train CONFIG` in this process; returns the runner it built and a Recorder."""
    built: list[tuple[Runner, Recorder]] = []

    def capture(cls, cfg):
        runner, recorder = FROM_CFG(cls, cfg), Recorder()
        runner.register_hook(recorder)
        built.append((runner, recorder))
        return runner

    monkeypatch.setattr(Runner, "from_cfg", classmethod(capture))

    def run(config: Path, *args: str) -> tuple[Runner, Recorder]:
        work_dir = tmp_path / f"run{len(built)}"
        assert cli.main(["train", str(config), "--work-dir", str(work_dir), *args]) == 0
        return built[-1]

    return run


def test_larc_snippet_trains_with_larc_and_vissls_schedule(train):
    runner, rec = train(CONFIGS / "larc.yaml")
    assert isinstance(runner.optim_wrapper.optimizer, Larc)
    group = runner.optim_wrapper.optimizer.param_groups[0]
    assert (group["trust_clip"], group["trust_coeff"], group["eps"]) == (False, 0.001, 1e-08)
    # The lr of every iteration is VISSL's: the composite schedule at where = iteration / 8.
    lr = Config.fromfile(CONFIGS / "larc.yaml").param_scheduler.to_dict()
    schedule = check_schedule({k: v for k, v in lr.items() if k not in ("type", "by_epoch")}, "lr")
    assert rec.lrs == pytest.approx([schedule_value(schedule, i / 8) for i in range(8)], rel=1e-12)
    assert len(rec.losses) == 8 and all(torch.isfinite(torch.tensor(rec.losses)))


def test_zero_snippet_shards_sgd(train):
    runner, rec = train(CONFIGS / "zero.yaml")
    optimizer = runner.optim_wrapper.optimizer
    assert isinstance(optimizer, ZeroRedundancyOptimizer) and isinstance(optimizer.optim, torch.optim.SGD)
    assert optimizer.param_groups[0]["weight_decay"] == 1e-06 and len(rec.losses) == 8


def test_amp_o1_snippet_runs_under_autocast(train):
    runner, rec = train(CONFIGS / "amp_o1.yaml")
    assert type(runner.optim_wrapper).__name__ == "AmpOptimWrapper"
    # dtype left to the device: fp16 on CUDA, bf16 where the CPU has it, else fp32 (this test's pin)
    assert runner.strategy.precision.dtype in (None, torch.float16, torch.bfloat16) and len(rec.losses) == 8


def test_amp_o3_snippet_runs_the_model_in_half_with_bn_fp32(train):
    runner, rec = train(CONFIGS / "amp_o3.yaml")
    model = runner.model
    assert model.trunk.embed.conv_proj.weight.dtype in (torch.float16, torch.bfloat16)  # bf16 on a CPU
    assert model.heads[0][1].weight.dtype == torch.float32  # the eval_mlp's BatchNorm2d: keep_batchnorm_fp32
    assert len(rec.losses) == 8 and all(torch.isfinite(torch.tensor(rec.losses)))


def test_activation_checkpointing_snippet_splits_the_trunk(train):
    runner, rec = train(CONFIGS / "activation_checkpointing.yaml")
    assert wrapped_forward(runner.model.trunk) is not None  # the trunk runs as 8 checkpointed segments
    assert len(rec.losses) == 8


def test_stateful_sampler_snippet(train, tmp_path):
    runner, rec = train(CONFIGS / "stateful_sampler.yaml")
    assert isinstance(runner.train_dataloader.sampler, DefaultSampler)
    assert isinstance(runner.val_dataloader.sampler, DefaultSampler)
    names = sorted(p.name for p in (tmp_path / "run0").glob("*.pth"))
    assert names == ["epoch_1.pth", "epoch_2.pth", "iter_2.pth", "iter_4.pth", "iter_6.pth", "iter_8.pth"]


def test_convert_prints_a_python_config_that_trains_the_same(train, tmp_path, capsys):
    source = CONFIGS / "larc.yaml"
    assert cli.main(["convert", str(source)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# Translated from {source} by `memfit convert`.")
    converted = tmp_path / "larc.py"
    converted.write_text(printed)
    compile(printed, str(converted), "exec")  # valid Python
    assert Config.fromfile(converted).to_dict() == Config.fromfile(source).to_dict()
    _, from_yaml = train(source)
    _, from_python = train(converted)
    assert from_python.losses == from_yaml.losses and from_python.lrs == from_yaml.lrs
