"""LoggerHook with MMEngine's arguments (mmengine/hooks/logger_hook.py): out_dir/out_suffix/keep_local,
interval_exp_name, log_metric_by_epoch, ignore_last, the storage options and the type checks."""

from __future__ import annotations

import json

import pytest

from memfit.errors import ConfigError
from memfit.evaluator.metric import BaseMetric
from memfit.hooks import LoggerHook
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model


class Count(BaseMetric):
    def process(self, data_batch, data_samples) -> None:
        self.results.append(len(data_samples[0]))

    def compute_metrics(self, results: list) -> dict:
        return {"n": float(sum(results))}


def _runner(work_dir, logger: dict, n: int = 16, val: bool = False, **kw) -> Runner:
    """``n`` samples, batch 4 (n/4 iterations per epoch), 2 epochs unless train_cfg says otherwise."""
    base = dict(model=regression_model(), work_dir=str(work_dir), randomness=dict(seed=0),
                train_dataloader=dict(batch_size=4, dataset=regression_data(n)),
                train_cfg=dict(by_epoch=True, max_epochs=2),
                optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                default_hooks=dict(checkpoint=None, logger={"tensorboard": False, **logger}))
    if val:
        base.update(val_dataloader=dict(batch_size=4, dataset=regression_data(4)), val_cfg=dict(),
                    val_evaluator=dict(type=Count))
    base.update(kw)
    return Runner(**base)


def _rows(runner) -> list[dict]:
    return [json.loads(line) for line in (runner.log_dir / "scalars.jsonl").read_text().splitlines()]


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "memfit"]


@pytest.mark.parametrize("keep_local", [True, False])
def test_out_dir_receives_the_logs_after_the_run(tmp_path, keep_local):
    runner = _runner("runs/exp", dict(interval=2, out_dir="logs", keep_local=keep_local))
    runner.train()
    runner.logger.info("a line after the run")
    out = tmp_path / "logs" / "exp"  # out_dir/<last folder of work_dir>, files by their path in the log dir
    log_name = f"{runner.timestamp}.log"
    assert sorted(p.name for p in out.iterdir()) == sorted([log_name, "scalars.jsonl"])
    assert "Epoch(train)  [2][4/4]" in (out / log_name).read_text()
    assert len((out / "scalars.jsonl").read_text().splitlines()) == 4  # iterations 2, 4, 6, 8
    local = [p.name for p in runner.log_dir.iterdir()]
    if keep_local:
        assert log_name in local and "scalars.jsonl" in local
    else:  # removed, and the log file is not opened again by a later line
        assert log_name not in local and "scalars.jsonl" not in local


def test_out_suffix_selects_what_is_copied(tmp_path):
    runner = _runner("runs/exp", dict(interval=2, out_dir=str(tmp_path / "logs"), out_suffix=".log"))
    runner.train()
    assert [p.name for p in (tmp_path / "logs" / "exp").iterdir()] == [f"{runner.timestamp}.log"]


def test_interval_exp_name_and_every_epoch_end(caplog):
    # MMEngine: 'Exp name' every interval_exp_name iterations and at the end of each epoch, before the log line.
    _runner("w", dict(interval=1, interval_exp_name=3), experiment_name="my_exp").train()
    messages = _messages(caplog)
    after = [messages[i + 1] for i, m in enumerate(messages) if m == "Exp name: my_exp"]
    # 2 epochs of 4 iterations: iterations 3 and 6 (every 3), 4 and 8 (epoch ends).
    assert [m.split("  lr")[0] for m in after] == ["Epoch(train)  [1][3/4]", "Epoch(train)  [1][4/4]",
                                                   "Epoch(train)  [2][2/4]", "Epoch(train)  [2][4/4]"]


def test_exp_name_defaults_to_the_timestamp(caplog):
    runner = _runner("w", dict(interval=100), train_cfg=dict(by_epoch=True, max_epochs=1))
    runner.train()
    assert _messages(caplog).count(f"Exp name: {runner.timestamp}") == 1  # the end of the only epoch


@pytest.mark.parametrize("by_epoch_metric, steps", [(True, [1, 2]), (False, [4, 8])])
def test_log_metric_by_epoch_sets_the_step_of_validation_scalars(by_epoch_metric, steps):
    runner = _runner("w", dict(interval=100, log_metric_by_epoch=by_epoch_metric), val=True)
    runner.train()
    assert [r["step"] for r in _rows(runner) if "val/n" in r] == steps  # after epochs 1 and 2 (4 iterations each)


def test_log_metric_by_epoch_false_in_an_iteration_run_goes_to_tensorboard():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runner = _runner("w", dict(interval=100, log_metric_by_epoch=False, tensorboard=True), val=True,
                     train_cfg=dict(by_epoch=False, max_iters=6, val_interval=3))
    runner.train()
    events = EventAccumulator(str(runner.log_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/n")] == [3, 6]
    assert [e.value for e in events.Scalars("val/n")] == [4.0, 4.0]


@pytest.mark.parametrize("interval, ignore_last, logged", [
    (2, True, [2, 4, 7, 9]),            # the epoch's last iteration (5 of 5) is not logged
    (2, False, [2, 4, 5, 7, 9, 10]),
    (6, True, [5, 10]),                 # an epoch no longer than the interval is logged anyway
])
def test_ignore_last(interval, ignore_last, logged):
    runner = _runner("w", dict(interval=interval, ignore_last=ignore_last), n=20)  # 5 iterations per epoch
    runner.train()
    assert [r["iter"] for r in _rows(runner)] == logged


def test_storage_options_local_warn_others_are_one_line_errors(caplog, tmp_path):
    LoggerHook(out_dir=str(tmp_path), backend_args=dict(backend="local"))
    assert any("default_hooks.logger.backend_args has no effect" in m for m in _messages(caplog))
    for kwargs, match in [(dict(out_dir="x", backend_args=dict(backend="petrel")), "backend='petrel' is not supported"),
                          (dict(file_client_args=dict(backend="disk")), "file_client_args is set without out_dir"),
                          (dict(out_dir="x", file_client_args={}, backend_args={}), "cannot both be set"),
                          (dict(out_dir="s3://bucket/logs"), "local disk only")]:
        with pytest.raises(ConfigError, match=match) as err:
            LoggerHook(**kwargs)
        assert str(err.value).startswith("default_hooks.logger") and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(interval_exp_name="100"), "interval_exp_name='100': use an int >= 1"),
    (dict(interval_exp_name=-1), "interval_exp_name=-1"),
    (dict(ignore_last="False"), "ignore_last='False': use True or False"),
    (dict(keep_local=1), "keep_local=1"),
    (dict(out_dir=1), "out_dir=1: must be a str or Path"),
    (dict(out_suffix=[100]), r"out_suffix=\[100\]: use a str or a tuple of str"),
])
def test_bad_arguments_are_one_line_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        _runner("w", kwargs)
    assert str(err.value).startswith("default_hooks.logger.") and "\n" not in str(err.value)


def test_visualizer_save_dir_warning_names_out_dir(caplog, monkeypatch):
    from memfit import errors
    from memfit.hooks.log_options import logger_kwargs

    monkeypatch.setattr(errors, "_WARNED", set())
    assert logger_kwargs(None, dict(type="Visualizer", save_dir="elsewhere")) == {}
    [message] = [m for m in _messages(caplog) if "visualizer.save_dir" in m]
    assert "default_hooks.logger.out_dir" in message
