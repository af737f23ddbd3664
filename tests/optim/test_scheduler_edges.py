"""Parameter schedulers at MMEngine's edges: the eta_min defaults of the cosine schedules, ReduceOnPlateau
in an iteration-based run, the step-order warnings and the order and types of argument errors.
Expected values from MMEngine's formulas and rules (mmengine/optim/scheduler/param_scheduler.py)."""

import math
import warnings

import pytest
import torch

import memfit.optim.scheduler as sched
from memfit.errors import ConfigError, ConfigTypeError
from memfit.hooks import Hook
from memfit.optim.scheduler import CosineAnnealingLR, CosineRestartLR, LinearLR, build_param_schedulers
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model, scripted_metric

BEFORE = r"Detected call of `scheduler\.step\(\)` before `optimizer\.step\(\)`"
OVERRIDDEN = r"Seems like `optimizer\.step\(\)` has been overridden after parameter value scheduler"


def _sgd(lr=0.05, momentum=0.9):
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=momentum)


def _values(optimizer, scheduler, steps, key="lr"):
    """The value each step trains with: read, step the optimizer, then the scheduler (the loop's order)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0][key])
        optimizer.step()
        scheduler.step()
    return out


def _build(cfg, opt=None, epoch_length=3):
    return build_param_schedulers(cfg, opt or _sgd(), max_epochs=4, max_iters=12, epoch_length=epoch_length)


# -- the cosine schedules' eta_min ---------------------------------------------------------------------
@pytest.mark.parametrize("form, key, base", [("LR", "lr", 0.05), ("Momentum", "momentum", 0.9)])
def test_cosine_annealing_without_eta_min_anneals_to_zero(form, key, base):
    # MMEngine: neither eta_min nor eta_min_ratio -> eta_min = 0: base * (1 + cos(pi * t / T_max)) / 2.
    opt = _sgd()
    s = getattr(sched, f"CosineAnnealing{form}")(opt, T_max=6, end=8)
    assert _values(opt, s, 8, key) == pytest.approx([base * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(8)])
    opt = _sgd()
    s = sched.CosineAnnealingParamScheduler(opt, param_name="momentum", T_max=6, end=8)
    assert _values(opt, s, 8, "momentum") == pytest.approx([0.9 * (1 + math.cos(math.pi * t / 6)) / 2
                                                            for t in range(8)])


def test_cosine_annealing_with_both_is_one_line_error():
    # MMEngine asserts (eta_min is None) ^ (eta_min_ratio is None) once the default is applied.
    with pytest.raises(ConfigError, match="not both"):
        CosineAnnealingLR(_sgd(), eta_min=0.0, eta_min_ratio=0.1)
    with pytest.raises(ConfigError, match=r"^param_scheduler: eta_min=0 and eta_min_ratio=0.1: .*drop one$"):
        _build(dict(type="CosineAnnealingLR", eta_min=0, eta_min_ratio=0.1))


def test_cosine_restart_needs_exactly_one_eta_min():
    # MMEngine's CosineRestart asserts exactly one (no eta_min=0 default); with eta_min_ratio 0.1 the
    # one period [4] anneals base=0.05 to eta_min=0.005: eta_min + (base - eta_min) * (1 + cos(pi * k / 4)) / 2,
    # then (past the last period) the value stays.
    for kwargs in (dict(), dict(eta_min=0.0, eta_min_ratio=0.1)):
        with pytest.raises(ConfigError, match="exactly one of `eta_min` and `eta_min_ratio`"):
            CosineRestartLR(_sgd(), periods=[4], **kwargs)
    opt = _sgd()
    closed = [0.005 + 0.045 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    got = _values(opt, CosineRestartLR(opt, periods=[4], eta_min_ratio=0.1), 6)
    assert got == pytest.approx(closed + closed[-1:] * 2)


# -- ReduceOnPlateau in an iteration-based run -----------------------------------------------------------
def test_plateau_in_an_iteration_based_run(tmp_path):
    # As in MMEngine: ReduceOnPlateauLR keeps by_epoch=True and ParamSchedulerHook.after_val_epoch steps it
    # with every validation's metrics (every 2 iterations here). Rule 'less', rel threshold 1e-4,
    # patience 1: validations 1-2 improve (1.0, 0.5), 3 is bad (1), 4 is bad (2 > patience) -> lr x 0.5
    # from iteration 9; 5 bad (1), 6 bad (2) -> x 0.5 again after the last iteration.
    lrs = []

    class Spy(Hook):
        def before_train_iter(self, runner, batch_idx, data_batch=None):
            lrs.append(runner.optim_wrapper.get_lr()["lr"][0])

    runner = Runner(model=regression_model(), work_dir=str(tmp_path),
                    train_dataloader=dict(batch_size=4, dataset=regression_data(8)),
                    train_cfg=dict(by_epoch=False, max_iters=12, val_interval=2),
                    val_dataloader=dict(batch_size=4, dataset=regression_data(4)), val_cfg=dict(),
                    val_evaluator=scripted_metric([{"mse": v} for v in (1.0, 0.5, 0.5, 0.5, 0.5, 0.5)]),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
                    param_scheduler=dict(type="ReduceOnPlateauLR", monitor="mse", factor=0.5, patience=1),
                    default_hooks=dict(checkpoint=None, logger=None), custom_hooks=[Spy()])
    runner.train()
    assert lrs == pytest.approx([0.1] * 8 + [0.05] * 4)
    assert runner.optim_wrapper.get_lr()["lr"][0] == pytest.approx(0.025)


def test_plateau_by_epoch_false_is_refused_as_mmengine():
    # MMEngine asserts by_epoch=True (its hook steps only epoch-based plateau schedulers with metrics).
    with pytest.raises(ConfigError, match=r"^param_scheduler: by_epoch=False: ReduceOnPlateauLR only supports "
                                          r"by_epoch=True.*drop by_epoch=False$"):
        _build(dict(type="ReduceOnPlateauLR", by_epoch=False))


# -- the step-order warnings ---------------------------------------------------------------------------
def test_scheduler_step_before_optimizer_step_warns_once():
    opt = _sgd()
    s = LinearLR(opt, start_factor=0.5, end=4, by_epoch=False)
    with pytest.warns(UserWarning, match=BEFORE) as record:
        s.step()
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.step()  # only the first step() is checked


def test_overridden_optimizer_step_warns_once():
    opt = _sgd()
    s = LinearLR(opt, start_factor=0.5, end=4)
    opt.step = lambda closure=None: None  # replaced after the scheduler counted its steps
    with pytest.warns(UserWarning, match=OVERRIDDEN) as record:
        s.step()
    assert len(record) == 1


def test_no_warning_when_the_optimizer_steps_first():
    opt = _sgd()
    first, second = LinearLR(opt, start_factor=0.5, end=4), CosineAnnealingLR(opt, T_max=4)  # one counter
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        first.step()
        second.step()


def test_runner_run_emits_neither_warning(tmp_path):
    # Iteration- and epoch-based schedulers stepped by ParamSchedulerHook after the optimizer steps.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Runner(model=regression_model(), work_dir=str(tmp_path),
               train_dataloader=dict(batch_size=4, dataset=regression_data(8)),
               train_cfg=dict(by_epoch=True, max_epochs=2), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
               param_scheduler=[dict(type="LinearLR", start_factor=0.5, end=3, by_epoch=False),
                                dict(type="MultiStepLR", milestones=[1])],
               default_hooks=dict(checkpoint=None, logger=None)).train()
    assert [str(w.message) for w in caught if "scheduler" in str(w.message)] == []


# -- the order and types of errors ------------------------------------------------------------------------
@pytest.mark.parametrize("epoch_length, error", [(None, ConfigError), (0, ConfigError), ("3", ConfigTypeError)])
def test_convert_to_iter_based_checks_epoch_length_first(epoch_length, error):
    # MMEngine's build_iter_from_epoch asserts epoch_length > 0 before the constructor sees begin/end.
    with pytest.raises(error, match=r"^param_scheduler\.convert_to_iter_based: epoch_length=") as exc:
        _build(dict(type="LinearLR", begin="a", end=-1, convert_to_iter_based=True), epoch_length=epoch_length)
    assert isinstance(exc.value, TypeError) == (error is ConfigTypeError)


@pytest.mark.parametrize("cfg, message", [
    (["LinearLR"], r"^param_scheduler\[0\]: expected a dict with 'type'"),
    (dict(type=3), r"^param_scheduler\.type=3: got int"),
    (dict(type="LinearLR", begin="1"), r"^param_scheduler\.begin='1': got str"),
    (dict(type="LinearLR", start_factor="0.5"), r"^param_scheduler: '>' not supported .*\(LinearLR\)$"),
    (dict(type="StepLR"), r"^param_scheduler: StepLR needs 'step_size'"),
])
def test_wrongly_typed_arguments_are_type_errors(cfg, message):
    # Where MMEngine raises TypeError (not a dict or a built scheduler, a type that is no str or class,
    # a comparison with a str, a missing argument) memfit raises ConfigTypeError, a TypeError.
    with pytest.raises(ConfigTypeError, match=message) as exc:
        _build(cfg)
    assert "\n" not in str(exc.value)
    with pytest.raises(TypeError, match="pass an Optimizer or an OptimWrapper"):
        LinearLR(object())


@pytest.mark.parametrize("cfg", [
    dict(type="LinearLR", begin=-1), dict(type="LinearLR", start_factor=2.0),
    dict(type="ReduceOnPlateauLR", factor=1.5), dict(type="ReduceOnPlateauLR", rule="more"),
])
def test_bad_values_are_value_errors(cfg):
    # Where MMEngine raises ValueError: ConfigError, not a TypeError.
    with pytest.raises(ConfigError) as exc:
        _build(cfg)
    assert not isinstance(exc.value, TypeError)
