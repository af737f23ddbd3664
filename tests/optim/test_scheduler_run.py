"""Parameter schedulers in a run: the config builder, ParamSchedulerHook, checkpoint state and the
Runner end to end. Expected values from MMEngine 0.10's formulas (see test_scheduler.py)."""

import math
from types import SimpleNamespace

import pytest
import torch

import memfit.optim.scheduler as sched
from memfit.errors import CheckpointError, ConfigError
from memfit.hooks import Hook, ParamSchedulerHook
from memfit.optim.scheduler import (
    CosineAnnealingLR,
    LinearLR,
    ParamScheduler,
    ReduceOnPlateauLR,
    build_param_schedulers,
    load_scheduler_state,
    scheduler_state,
)
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model


def _sgd(lr=0.05):
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=0.9)


def _build(cfg, opt, by_epoch_run=True, max_epochs=4, epoch_length=3):
    return build_param_schedulers(cfg, opt, by_epoch_run=by_epoch_run, max_epochs=max_epochs,
                                  max_iters=max_epochs * epoch_length, epoch_length=epoch_length)


def _lrs(opt, scheds, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        for s in scheds:
            s.step()
    return out


# -- the builder ---------------------------------------------------------------------------------------
def test_defaults_follow_the_run():
    # by_epoch defaults to the run's; end to max_epochs / max_iters in that unit.
    (s,) = _build(dict(type="LinearLR"), _sgd())
    assert (s.by_epoch, s.begin, s.end) == (True, 0, 4)
    (s,) = _build(dict(type="LinearLR"), _sgd(), by_epoch_run=False)
    assert (s.by_epoch, s.begin, s.end) == (False, 0, 12)
    (s,) = _build(dict(type="ReduceOnPlateauLR"), _sgd(), by_epoch_run=False)  # epoch-based only
    assert s.by_epoch and s.end == 4


def test_convert_to_iter_based_through_the_config():
    # LinearLR(start_factor=0.5, end=2) over epochs of 3 iterations: 0.05 * (0.5 + 0.5 * t / 5), t = 0..5.
    opt = _sgd()
    (s,) = _build(dict(type="LinearLR", start_factor=0.5, end=2, convert_to_iter_based=True), opt)
    assert (s.by_epoch, s.begin, s.end) == (False, 0, 6)
    assert _lrs(opt, [s], 7) == pytest.approx([0.05 * (0.5 + 0.5 * t / 5) for t in range(6)] + [0.05])
    (s,) = _build(dict(type="CosineAnnealingLR", convert_to_iter_based=True), _sgd())  # end = max_epochs * 3
    assert (s.end, s.T_max) == (12, 12)
    with pytest.raises(ConfigError, match=r"param_scheduler: convert_to_iter_based=True converts an epoch-based"):
        _build(dict(type="LinearLR", by_epoch=False, convert_to_iter_based=True), _sgd())


@pytest.mark.parametrize("cfg, message", [
    ([dict(type="LinearLR", begin=3, end=3)], r"^param_scheduler\[0\]: end=3 is not after begin=3"),
    (dict(type="StepLR", step_sise=1), r"^param_scheduler: unknown key 'step_sise'.*did you mean 'step_size'"),
    (dict(type="LinearLR", start_factor=2.0), r"^param_scheduler: starting multiplicative factor .*\(LinearLR\)$"),
    (dict(type="LambdaLR", lr_lambda=abs), r"^param_scheduler: LambdaLR is torch's scheduler, which ignores"),
    (dict(type="ReduceLROnPlateau"), r"use MMEngine's \(ReduceOnPlateauLR\)"),
    (dict(type=torch.optim.lr_scheduler.StepLR, step_size=1), r"StepLR is torch's scheduler"),
    (["LinearLR"], r"^param_scheduler\[0\]: expected a dict with 'type'"),
    (dict(type="LinearLR", convert_to_iter_based=True, start_factor=-1), r"\(LinearLR\)$"),
])
def test_bad_config_is_one_line(cfg, message):
    with pytest.raises(ConfigError, match=message) as exc:
        _build(cfg, _sgd())
    assert "\n" not in str(exc.value)


class _Wrappers:
    """A stand-in for OptimWrapperDict: ``optim_wrappers`` and ``items()``."""

    def __init__(self, **optimizers):
        self.optim_wrappers = optimizers

    def items(self):
        return self.optim_wrappers.items()


def test_several_optimizers():
    gen, disc = _sgd(0.1), _sgd(0.2)
    out = _build(dict(generator=dict(type="ConstantLR", factor=0.5), discriminator=[dict(type="StepLR", step_size=1)]),
                 _Wrappers(generator=gen, discriminator=disc))
    assert [type(s).__name__ for s in out["generator"]] == ["ConstantLR"]
    assert gen.param_groups[0]["lr"] == pytest.approx(0.05) and disc.param_groups[0]["lr"] == pytest.approx(0.2)
    shared = _build([dict(type="ConstantLR", factor=0.5)], _Wrappers(a=_sgd(0.1), b=_sgd(0.2)))
    assert [s.optimizer.param_groups[0]["lr"] for s in (shared["a"][0], shared["b"][0])] == pytest.approx([0.05, 0.1])
    with pytest.raises(ConfigError, match="param_scheduler: no optimizer named 'generater'.*'generator'"):
        _build(dict(generater=dict(type="ConstantLR")), _Wrappers(generator=_sgd()))


def test_schedules_the_wrappers_base_param_settings_group():
    # MMEngine's OptimWrapper.param_groups holds a pseudo group (base_param_settings) with several
    # groups: schedulers iterate param_groups, so base_lr follows the same schedule.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=0.05)
    wrapper = SimpleNamespace(optimizer=opt, param_groups=opt.param_groups + [{"params": [], "lr": 0.05}])
    (s,) = _build(dict(type="LinearLR", start_factor=0.5), wrapper)  # end 4: 0.5, 2/3, 5/6, 1
    s.step()
    assert [g["lr"] for g in wrapper.param_groups] == pytest.approx([0.05 * 2 / 3, 0.5 * 2 / 3, 0.05 * 2 / 3])


# -- the hook ------------------------------------------------------------------------------------------
def test_hook_steps_by_unit_and_plateau_with_metrics():
    opt = _sgd()
    per_iter, per_epoch = LinearLR(opt, start_factor=0.5, end=3, by_epoch=False), _Counter(by_epoch=True)
    plateau = ReduceOnPlateauLR(opt, monitor="loss", patience=0, factor=0.5)
    runner = SimpleNamespace(param_schedulers=[per_iter, per_epoch, plateau])
    hook = ParamSchedulerHook()
    hook.after_train_iter(runner, 0)
    assert per_iter.last_step == 1 and per_epoch.steps == 0 and plateau._global_step == 0
    hook.after_train_epoch(runner)
    assert per_iter.last_step == 1 and per_epoch.steps == 1 and plateau._global_step == 1
    hook.after_val_epoch(runner, None)  # no metrics: nothing
    assert plateau.last_step == -1
    runner.param_schedulers = [plateau]
    lr = opt.param_groups[0]["lr"]
    hook.after_val_epoch(runner, {"loss": 1.0})  # patience 0: the first metric is the best so far
    hook.after_val_epoch(runner, {"loss": 1.0})  # not better: x 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5)
    runner.param_schedulers = {"a": [per_epoch]}  # one list per optimizer
    hook.after_train_epoch(runner)
    assert per_epoch.steps == 2
    runner.param_schedulers = {"a": [per_epoch, plateau]}  # not all ParamSchedulers: MMEngine skips the list
    hook.after_val_epoch(runner, {"loss": 0.0})
    assert plateau.best == 1.0
    runner.param_schedulers = (per_epoch,)
    with pytest.raises(TypeError, match="runner.param_schedulers should be list of ParamScheduler or a dict"):
        hook.after_train_epoch(runner)


class _Counter:
    """Any object with step() and by_epoch is a scheduler to the hook."""

    def __init__(self, by_epoch):
        self.by_epoch, self.steps = by_epoch, 0

    def step(self):
        self.steps += 1


# -- state ---------------------------------------------------------------------------------------------
def _chain(opt):
    return [LinearLR(opt, start_factor=0.1, end=4), CosineAnnealingLR(opt, begin=4, end=10, eta_min=1e-4)]


def test_state_round_trip_continues_the_same(tmp_path):
    full_opt = _sgd()
    full = _lrs(full_opt, _chain(full_opt), 10)
    opt = _sgd()
    chain = _chain(opt)
    first = _lrs(opt, chain, 6)
    torch.save({"optimizer": opt.state_dict(), "schedulers": scheduler_state(chain)}, tmp_path / "c.pth")
    saved = torch.load(tmp_path / "c.pth", weights_only=True)  # plain data only
    opt2 = _sgd()
    chain2 = _chain(opt2)
    opt2.load_state_dict(saved["optimizer"])
    for s, st in zip(chain2, saved["schedulers"]):
        s.load_state_dict(st)
    assert first + _lrs(opt2, chain2, 4) == full
    # LinearLR(0.1, end=4): 0.05 * (0.1 + 0.9 * t / 3); cosine from 0.05 to 1e-4 over 6 steps.
    assert full == pytest.approx([0.005, 0.02, 0.035, 0.05]
                                 + [1e-4 + (0.05 - 1e-4) * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(6)])


@pytest.mark.parametrize("name", [n for n in sched.__all__ if n.endswith(("LR", "Momentum"))])
def test_every_scheduler_state_is_weights_only(tmp_path, name):
    opt = _sgd()
    kwargs = dict(step_size=2, milestones=[1], gamma=0.5, periods=[2], eta_min=0.0, eta_max=0.1, total_steps=4)
    cls = getattr(sched, name)
    s = cls(opt, **{k: v for k, v in kwargs.items() if k in cls.__signature__.parameters})
    s.step(*([{"loss": 1.0}] if getattr(s, "need_val_args", False) else []))
    torch.save(s.state_dict(), tmp_path / "s.pth")
    assert torch.load(tmp_path / "s.pth", weights_only=True) == s.state_dict()


def _runner_with(schedulers, length=4):
    records = []
    return SimpleNamespace(param_schedulers=schedulers, logger=SimpleNamespace(warning=records.append),
                           train_loop=SimpleNamespace(iters_per_epoch=length)), records


def test_load_scheduler_state_checks_and_warns():
    opt = _sgd()
    saved = {"param_schedulers": scheduler_state([LinearLR(opt, start_factor=0.5, end=4)]),
             "loop": {"epoch": 1, "iter": 6, "batch_in_epoch": 2}}
    runner, warnings = _runner_with([LinearLR(_sgd(), start_factor=0.5, end=4)])
    load_scheduler_state(runner, saved, "x.pth")
    assert warnings == ["x.pth: resumed at iteration 6, 2 iterations into an epoch of 4: the epoch-based param "
                        "schedulers keep this epoch's value until it ends"]
    runner, warnings = _runner_with([LinearLR(_sgd(), start_factor=0.5, end=4)])
    load_scheduler_state(runner, {**saved, "loop": {"iter": 8}}, "x.pth")
    assert warnings == []
    runner, _ = _runner_with([])
    with pytest.raises(CheckpointError, match="^x.pth: holds 1 param schedulers, the config has 0"):
        load_scheduler_state(runner, saved, "x.pth")
    runner, _ = _runner_with([LinearLR(_sgd(), start_factor=0.5, end=4)])
    with pytest.raises(CheckpointError, match="older memfit"):
        load_scheduler_state(runner, {"param_schedulers": [{"scheduler": {}, "steps": 3}]}, "x.pth")
    runner, _ = _runner_with({"g": [LinearLR(_sgd(), start_factor=0.5, end=4)]})
    with pytest.raises(CheckpointError, match="holds the param schedulers of one optimizer, the config builds"):
        load_scheduler_state(runner, saved, "x.pth")
    runner, _ = _runner_with({"g": [LinearLR(_sgd(), start_factor=0.5, end=4, by_epoch=False)]})
    load_scheduler_state(runner, {"param_schedulers": {"g": saved["param_schedulers"]}}, "x.pth")
    assert runner.param_schedulers["g"][0].by_epoch  # the saved state wins, as MMEngine's load_state_dict


# -- end to end ----------------------------------------------------------------------------------------
def test_runner_two_constant_lrs_over_three_epochs(tmp_path):
    # ConstantLR(0.5, begin=0, end=3) and ConstantLR(0.5, begin=1, end=3), base lr 0.1, by_epoch with
    # end defaulting to max_epochs = 3. MMEngine: epoch 0: A x0.5 -> 0.05 (B not begun);
    # epoch 1: B starts x0.5 -> 0.025; epoch 2: A restores at step end-begin-1 = 2 (/0.5) and B at its
    # step 1 = 3-1-1 (/0.5) -> 0.1.
    lrs = []

    class Spy(Hook):
        def before_train_epoch(self, runner):
            lrs.append(runner.optim_wrapper.get_lr()["lr"][0])

    Runner(model=regression_model(), work_dir=str(tmp_path),
           train_dataloader=dict(batch_size=8, dataset=regression_data(16), sampler=dict(type="DefaultSampler")),
           train_cfg=dict(by_epoch=True, max_epochs=3), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
           param_scheduler=[dict(type="ConstantLR", factor=0.5, begin=0), dict(type="ConstantLR", factor=0.5, begin=1)],
           default_hooks=dict(checkpoint=None, logger=None), custom_hooks=[Spy()]).train()
    assert lrs == pytest.approx([0.05, 0.025, 0.1])


def test_param_scheduler_is_the_base_class():
    assert issubclass(LinearLR, ParamScheduler) and issubclass(ReduceOnPlateauLR, ParamScheduler)
