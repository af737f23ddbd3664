"""What a run writes and shows besides the log line: TensorBoard scalars, the progress bar; and two
Runner switches that change the run: auto_scale_lr and compile."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.errors import ConfigError
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model


def _runner(work_dir, batch_size=4, **kw):
    base = dict(model=regression_model(), work_dir=str(work_dir), randomness=dict(seed=0),
                train_dataloader=dict(batch_size=batch_size, dataset=regression_data(),
                                      sampler=dict(type="DefaultSampler", shuffle=False)),
                train_cfg=dict(by_epoch=True, max_epochs=2), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                default_hooks=dict(checkpoint=None, logger=dict(interval=2)))
    base.update(kw)
    return Runner(**base)


def test_tensorboard_holds_the_logged_scalars():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runner = _runner("w")
    runner.train()
    events = EventAccumulator(str(runner.log_dir / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("loss")]  # MMEngine's tag names
    steps = [e.step for e in events.Scalars("loss")]
    rows = [json.loads(line) for line in (runner.log_dir / "scalars.jsonl").read_text().splitlines()]
    json_losses = [r["loss"] for r in rows if "loss" in r]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16] and len(losses) == 8  # every 2 of 16 iterations
    assert losses == pytest.approx(json_losses, rel=1e-6) and losses[-1] < losses[0]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.05] * 8)


def test_tensorboard_can_be_switched_off():
    runner = _runner("w", default_hooks=dict(checkpoint=None, logger=dict(interval=2, tensorboard=False)))
    runner.train()
    assert not (runner.log_dir / "tensorboard").exists() and (runner.log_dir / "scalars.jsonl").is_file()


def test_progress_bar_counts_the_iterations(capsys):
    from memfit.hooks import Hook
    from memfit.hooks.logger import LoggerHook

    counts = []

    class Spy(Hook):
        priority = "HIGHEST"  # its after_train runs before the logger closes the bar

        def after_train(self, runner):
            bar = next(h for h in runner.hooks if isinstance(h, LoggerHook))._bar
            counts.append((bar.n, bar.total))

    runner = _runner("w", default_hooks=dict(checkpoint=None, logger=dict(interval=2, progress_bar=True)),
                     custom_hooks=[Spy()])
    runner.train()
    assert counts == [(16, 16)] and "train:" in capsys.readouterr().err
    quiet = _runner("q", default_hooks=dict(checkpoint=None, logger=dict(interval=2, progress_bar=False)))
    quiet.train()
    assert "train:" not in capsys.readouterr().err


def test_auto_scale_lr_scales_by_the_real_batch():
    runner = _runner("w", batch_size=8, auto_scale_lr=dict(enable=True, base_batch_size=4))
    runner.train()
    assert runner.optim_wrapper.get_lr()["lr"] == [pytest.approx(0.1)]  # 0.05 * 8 / 4
    off = _runner("w2", batch_size=8, auto_scale_lr=dict(enable=False, base_batch_size=4))
    off.train()
    assert off.optim_wrapper.get_lr()["lr"] == [pytest.approx(0.05)]
    with pytest.raises(ConfigError, match="base_batch_size"):
        _runner("w3", auto_scale_lr=dict(enable=True)).train()


def test_compile_trains_the_same_weights():
    plain = _runner("a")
    plain.train()
    compiled = _runner("b", compile=dict(backend="eager"))  # the kwargs reach torch.compile
    compiled.train()
    assert compiled.model._compiled_call_impl is not None
    assert torch.allclose(compiled.model.fc.weight, plain.model.fc.weight, atol=1e-6)
