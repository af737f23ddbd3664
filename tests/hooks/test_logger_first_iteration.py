"""LoggerHook's early line: the first iteration a run executes is logged (console and log file), so a
log shows progress at once; the lines every `interval` iterations and the scalar files are unchanged."""

from __future__ import annotations

import json

import memfit.hooks.logger as logger_module
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model


def _runner(train_cfg: dict, checkpoint: dict | None = None, **kw) -> Runner:
    """32 samples in batches of 4 (8 iterations an epoch), a log line every 3 iterations."""
    return Runner(model=regression_model(), work_dir="w", randomness=dict(seed=0),
                  train_dataloader=dict(batch_size=4, dataset=regression_data(32)), train_cfg=train_cfg,
                  optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                  default_hooks=dict(logger=dict(interval=3, tensorboard=False), checkpoint=checkpoint), **kw)


def _heads(caplog) -> list[str]:
    return [r.getMessage().split("  lr")[0] for r in caplog.records if "(train)  [" in r.getMessage()]


def test_the_first_iteration_is_logged_but_not_written_to_the_scalars(caplog, monkeypatch):
    resets = []
    peak = logger_module.peak_memory_mb
    monkeypatch.setattr(logger_module, "peak_memory_mb", lambda device, reset=True: resets.append(reset)
                        or peak(device, reset))
    runner = _runner(dict(by_epoch=True, max_epochs=2))
    runner.train()
    assert _heads(caplog) == ["Epoch(train)  [1][1/8]", "Epoch(train)  [1][3/8]", "Epoch(train)  [1][6/8]",
                              "Epoch(train)  [1][8/8]", "Epoch(train)  [2][3/8]", "Epoch(train)  [2][6/8]",
                              "Epoch(train)  [2][8/8]"]
    rows = [json.loads(line) for line in (runner.log_dir / "scalars.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6, 8, 11, 14, 16]  # as without the early line
    assert resets == [False] + [True] * 6  # the CUDA peak of the first interval still reaches its line


def test_the_first_iteration_after_a_resume_is_logged(caplog):
    _runner(dict(by_epoch=False, max_iters=4), checkpoint=dict(interval=4, by_epoch=False)).train()
    caplog.clear()
    _runner(dict(by_epoch=False, max_iters=8), resume=True).train()
    assert _heads(caplog)[:2] == ["Iter(train)  [5/8]", "Iter(train)  [6/8]"]
