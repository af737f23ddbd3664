"""Scheduler arguments that MMEngine accepts and then fails on at a later step are refused at build;
a default ``end`` the run makes too short says where it came from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError, ConfigTypeError
from memfit.optim.scheduler import INF, ConstantLR, StepLR, build_param_schedulers


def sgd() -> torch.optim.SGD:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)


def build(cfg, by_epoch_run: bool = True):
    return build_param_schedulers(cfg, sgd(), by_epoch_run=by_epoch_run, max_epochs=3, max_iters=60, epoch_length=20)


@pytest.mark.parametrize("cfg, error, message", [
    (dict(type="StepLR", step_size=0), ConfigError,
     "param_scheduler: step_size=0: use a positive number of epochs between two multiplications by gamma"),
    (dict(type="StepMomentum", step_size=-2, by_epoch=False), ConfigError,
     "param_scheduler: step_size=-2: use a positive number of iterations"),
    (dict(type="StepLR", step_size="3"), ConfigTypeError, "param_scheduler: step_size='3': use a positive number"),
    (dict(type="ConstantLR", factor=0), ConfigError,
     "param_scheduler: factor=0: the value is restored at end by dividing by factor: use a factor in (0, 1]"),
])
def test_arguments_that_would_fail_at_a_step_are_refused_at_build(cfg, error, message):
    with pytest.raises(error) as exc:
        build(cfg)
    assert str(exc.value).startswith(message)


def test_what_mmengine_runs_still_builds():
    # A fractional step_size is MMEngine's too (step_size * epoch_length after conversion); factor=0 without an
    # end never divides (the value is never restored).
    assert StepLR(sgd(), step_size=2.5).step_size == 2.5
    assert ConstantLR(sgd(), factor=0.0, end=INF).factor == 0.0
    assert len(build(dict(type="StepLR", step_size=1, by_epoch=True, convert_to_iter_based=True))) == 1


@pytest.mark.parametrize("cfg, by_epoch_run, source, fix", [
    (dict(type="CosineAnnealingLR", by_epoch=False, begin=100), True,
     "end=60 = 3 epochs x 20 iterations (end not set: the run's length) is not after begin=100",
     "count it in epochs (by_epoch=True, convert_to_iter_based=True, begin=0)"),
    (dict(type="CosineAnnealingLR", by_epoch=True, begin=5), True,
     "end=3 (end not set: train_cfg.max_epochs) is not after begin=5", "lower begin or raise train_cfg.max_epochs"),
    (dict(type="CosineAnnealingLR", by_epoch=False, begin=100), False,
     "end=60 (end not set: train_cfg.max_iters) is not after begin=100", "lower begin or raise train_cfg.max_iters"),
])
def test_a_default_end_says_where_it_came_from(cfg, by_epoch_run, source, fix):
    with pytest.raises(ConfigError) as exc:
        build([dict(type="LinearLR", by_epoch=False, end=10), cfg], by_epoch_run)
    assert str(exc.value).startswith(f"param_scheduler[1]: {source}: the run ends before the scheduler starts: ")
    assert fix in str(exc.value)
