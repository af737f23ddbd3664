"""Parameter scheduler values, step by step, against MMEngine 0.10's formulas and its own tests
(tests/test_optim/test_scheduler/ in MMEngine). Every expected number below is written from those
formulas, never from memfit's output; the comment by each says which."""

import math

import pytest
import torch

import memfit.optim.scheduler as sched
from memfit.optim.scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    CosineRestartLR,
    ExponentialLR,
    LinearLR,
    MultiStepLR,
    OneCycleLR,
    PolyLR,
    StepLR,
)


def _sgd(lr=0.05, momentum=0.9, weight_decay=1e-4):
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def _values(optimizer, schedulers, steps, key="lr", metrics=None):
    """The value each of ``steps`` epochs trains with: read, then step every scheduler (the hook's order)."""
    out = []
    for i in range(steps):
        group = optimizer.param_groups[0]
        out.append(group["betas"][0] if key == "betas" else group[key])
        for s in schedulers:
            s.step(*([] if metrics is None else [metrics[i]]))
    return out


def _close(got, expected):
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), f"\n got {got}\nwant {expected}"


# -- the cases of issue 13 (base lr 0.05) -------------------------------------------------------------
def test_linear_reaches_full_lr_after_end_minus_begin_minus_one_steps():
    # factor(t) = start + (1 - start) * t / (end - begin - 1), t = 0..4 (MMEngine test_linear_scheduler)
    opt = _sgd()
    _close(_values(opt, [LinearLR(opt, start_factor=0.5, end=5)], 7),
           [0.025, 0.03125, 0.0375, 0.04375, 0.05, 0.05, 0.05])


def test_nothing_changes_before_begin():
    # MMEngine test_effective_interval: begin=1, end=6: 0.05 at epoch 0, then the same ramp.
    opt = _sgd()
    _close(_values(opt, [LinearLR(opt, start_factor=0.5, begin=1, end=6)], 8),
           [0.05, 0.025, 0.03125, 0.0375, 0.04375, 0.05, 0.05, 0.05])


def test_constant_restored_at_end_minus_one():
    # MMEngine test_constant_scheduler: [0.025] * 4 + [0.05] * 6 for end=5.
    opt = _sgd()
    _close(_values(opt, [ConstantLR(opt, factor=0.5, end=5)], 7), [0.025] * 4 + [0.05] * 3)


def test_exponential_then_cosine_chain():
    # MMEngine test_multi_scheduler_without_overlap_exp_cosine: 0.05 * 0.9^t for t < 5, then a cosine
    # from 0.05 * 0.9^4 = 0.0328 (the exponential decays 4 times, not 5) to eta_min over T_max = 5.
    opt = _sgd()
    chain = [ExponentialLR(opt, gamma=0.9, end=5), CosineAnnealingLR(opt, begin=5, end=10)]
    got = _values(opt, chain, 10)
    assert got[5] == pytest.approx(0.0328050)
    _close(got, [0.05 * 0.9 ** t for t in range(5)]
           + [0.05 * 0.9 ** 4 * (1 + math.cos(math.pi * t / 5)) / 2 for t in range(5)])


def test_overlapping_linear_and_multistep():
    # MMEngine test_multi_scheduler_with_overlap: both act on epoch 3 (0.04375 * 0.1).
    opt = _sgd()
    chain = [LinearLR(opt, start_factor=0.5, begin=0, end=5), MultiStepLR(opt, gamma=0.1, milestones=[3, 6, 9], end=10)]
    _close(_values(opt, chain, 10), [0.025, 0.03125, 0.0375, 0.004375] + [0.005] * 2 + [0.0005] * 3 + [0.00005])


def test_linear_start_factor_zero():
    # MMEngine accepts start_factor=0 but its chained form then divides by zero at the second step;
    # memfit continues with the closed form of the same formula: 0.05 * t / 4.
    opt = _sgd()
    _close(_values(opt, [LinearLR(opt, start_factor=0.0, end=5)], 6), [0.0, 0.0125, 0.025, 0.0375, 0.05, 0.05])


def test_end_not_after_begin_is_an_error():
    with pytest.raises(ValueError, match="end should be larger than begin"):
        StepLR(_sgd(), step_size=3, begin=5, end=5)


@pytest.mark.parametrize("factor", [-0.1, 1.5])
def test_factors_outside_0_1_are_errors(factor):
    with pytest.raises(ValueError, match="between 0 and 1"):
        LinearLR(_sgd(), start_factor=factor, end=4)
    with pytest.raises(ValueError, match="between 0 and 1"):
        ConstantLR(_sgd(), factor=factor, end=4)


# -- each scheduler, LR form --------------------------------------------------------------------------
def test_step_and_multistep():
    # MMEngine test_step_scheduler / test_multi_step_scheduler.
    opt = _sgd()
    _close(_values(opt, [StepLR(opt, step_size=3, gamma=0.1)], 10), [0.05] * 3 + [0.005] * 3 + [0.0005] * 3 + [5e-5])
    opt = _sgd()
    _close(_values(opt, [MultiStepLR(opt, milestones=[2, 5, 9], gamma=0.1)], 10),
           [0.05] * 2 + [0.005] * 3 + [0.0005] * 4 + [5e-5])


def test_cosine_eta_min_and_eta_min_ratio():
    # eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2 (MMEngine test_cos_anneal_scheduler).
    opt = _sgd()
    _close(_values(opt, [CosineAnnealingLR(opt, T_max=10, eta_min=1e-3, end=12)], 12),
           [1e-3 + (0.05 - 1e-3) * (1 + math.cos(math.pi * t / 10)) / 2 for t in range(12)])
    opt = _sgd()  # eta_min = base * eta_min_ratio = 0.005; T_max defaults to end - begin
    _close(_values(opt, [CosineAnnealingLR(opt, eta_min_ratio=0.1, end=8)], 8),
           [0.005 + 0.045 * (1 + math.cos(math.pi * t / 8)) / 2 for t in range(8)])


def test_poly_with_eta_min():
    # eta_min + (base - eta_min) * (1 - t / (end - 1)) ** power (MMEngine test_poly_scheduler).
    opt = _sgd()
    _close(_values(opt, [PolyLR(opt, power=0.9, eta_min=0.001, end=5)], 8),
           [0.001 + 0.049 * (1 - t / 4) ** 0.9 for t in range(4)] + [0.001] * 4)


def test_cosine_restart():
    # MMEngine test_cosine_restart_scheduler, periods [4, 5], restart weights [1, 0.5], eta_min 0.
    opt = _sgd()
    got = _values(opt, [CosineRestartLR(opt, periods=[4, 5], restart_weights=[1, 0.5], eta_min=0, end=10)], 10)
    assert got == pytest.approx([0.05, 0.0426776, 0.025, 0.00732233, 0.025, 0.022612712, 0.01636271, 0.0086372,
                                 0.0023872, 0.0023872], abs=1e-7)
    with pytest.raises(ValueError, match="exactly one of"):
        CosineRestartLR(_sgd(), periods=[4], eta_min=0, eta_min_ratio=0.1)


@pytest.mark.parametrize("kwargs, expected", [
    # MMEngine test_onecycle_lr: eta_max 25, initial 25 / 25 = 1, min 1 / final_div_factor.
    (dict(final_div_factor=2, anneal_strategy="linear"), [1., 13., 25., 21.5, 18., 14.5, 11., 7.5, 4., 0.5]),
    (dict(pct_start=0.4, final_div_factor=4, three_phase=True, anneal_strategy="linear"),
     [1., 9., 17., 25., 17., 9., 1., 0.75, 0.5, 0.25]),
    (dict(final_div_factor=2), [1., 13., 25.] + [0.5 + 24.5 / 2 * (math.cos(math.pi * k / 7) + 1) for k in range(1, 7)]
     + [0.5]),
])
def test_one_cycle(kwargs, expected):
    opt = _sgd()
    _close(_values(opt, [OneCycleLR(opt, eta_max=25, total_steps=10, end=10, **kwargs)], 10), expected)


# -- convert_to_iter_based (epoch_length = 3) ----------------------------------------------------------
def test_convert_to_iter_based():
    # begin/end and the epoch-counted arguments times 3 (MMEngine's *_convert_iterbased tests):
    # linear over 5 * 3 - 1 = 14 iterations; constant restored at iteration 14; milestones 3, 6.
    opt = _sgd()
    _close(_values(opt, [LinearLR.build_iter_from_epoch(opt, start_factor=0.5, end=5, epoch_length=3)], 16),
           [0.05 * (0.5 + 0.5 * t / 14) for t in range(15)] + [0.05])
    opt = _sgd()
    _close(_values(opt, [ConstantLR.build_iter_from_epoch(opt, factor=0.5, end=5, epoch_length=3)], 16),
           [0.025] * 14 + [0.05] * 2)
    opt = _sgd()
    _close(_values(opt, [MultiStepLR.build_iter_from_epoch(opt, milestones=[1, 2], epoch_length=3)], 8),
           [0.05] * 3 + [0.005] * 3 + [0.0005] * 2)
    opt = _sgd()
    _close(_values(opt, [CosineAnnealingLR.build_iter_from_epoch(opt, T_max=2, end=2, epoch_length=3)], 6),
           [0.05 * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(6)])
    with pytest.raises(ValueError, match="epoch_length"):
        StepLR.build_iter_from_epoch(opt, step_size=1, epoch_length=-1)


# -- the momentum and generic forms of every scheduler: value = base * factor(t) ------------------------
# factor(t) of each schedule from its closed form (the chained MMEngine form equals it when one
# scheduler owns the value): Step, MultiStep, Constant, Exponential, Cosine, Linear, Poly, CosineRestart.
_FACTORS = [
    ("Step", dict(step_size=3, gamma=0.5), [1, 1, 1, .5, .5, .5, .25, .25]),
    ("MultiStep", dict(milestones=[2, 5], gamma=0.1), [1, 1, .1, .1, .1, .01, .01, .01]),
    ("Constant", dict(factor=0.5, end=5), [.5, .5, .5, .5, 1, 1, 1, 1]),
    ("Exponential", dict(gamma=0.9), [0.9 ** t for t in range(8)]),
    ("CosineAnnealing", dict(T_max=4, end=8), [(1 + math.cos(math.pi * t / 4)) / 2 for t in range(8)]),
    ("Linear", dict(start_factor=0.5, end=5), [0.5 + 0.5 * min(t, 4) / 4 for t in range(8)]),
    ("Poly", dict(power=2.0, end=6), [(1 - min(t, 5) / 5) ** 2 for t in range(8)]),
    ("CosineRestart", dict(periods=[4, 5], restart_weights=[1, 0.5], eta_min=0),
     [1, (1 + math.cos(math.pi / 4)) / 2, .5, (1 - math.cos(math.pi / 4)) / 2]
     + [0.5 * (1 + math.cos(math.pi * k / 5)) / 2 for k in range(4)]),
]


@pytest.mark.parametrize("name, kwargs, factors", _FACTORS, ids=[f[0] for f in _FACTORS])
def test_every_form_of_every_scheduler(name, kwargs, factors):
    kwargs = dict(kwargs, end=kwargs.get("end", 100))
    opt = _sgd()
    _close(_values(opt, [getattr(sched, f"{name}LR")(opt, **kwargs)], 8), [0.05 * f for f in factors])
    opt = _sgd()  # SGD: the momentum itself
    _close(_values(opt, [getattr(sched, f"{name}Momentum")(opt, **kwargs)], 8, "momentum"), [0.9 * f for f in factors])
    adam = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=0.01, betas=(0.9, 0.999))
    _close(_values(adam, [getattr(sched, f"{name}Momentum")(adam, **kwargs)], 8, "betas"), [0.9 * f for f in factors])
    assert adam.param_groups[0]["betas"][1] == 0.999  # Adam-family: only betas[0] is the momentum
    opt = _sgd()
    generic = getattr(sched, f"{name}ParamScheduler")(opt, param_name="weight_decay", **kwargs)
    _close(_values(opt, [generic], 8, "weight_decay"), [1e-4 * f for f in factors])
    assert opt.param_groups[0]["lr"] == 0.05  # a weight_decay scheduler leaves the lr alone


def test_momentum_scheduler_needs_a_momentum():
    asgd = torch.optim.ASGD(torch.nn.Linear(2, 2).parameters(), lr=0.01)
    with pytest.raises(ValueError, match="optimizer must support momentum"):
        sched.StepMomentum(asgd, step_size=1)


def test_one_cycle_is_for_the_lr_only():
    with pytest.raises(ValueError, match="only works for the learning rate"):
        sched.OneCycleParamScheduler(_sgd(), param_name="momentum", eta_max=1.0, total_steps=4)


# -- ReduceOnPlateau ---------------------------------------------------------------------------------
@pytest.mark.parametrize("form, key, base", [("LR", "lr", 0.05), ("Momentum", "momentum", 0.9)])
def test_reduce_on_plateau(form, key, base):
    # MMEngine test_reduce_on_plateau_scheduler (rule less, rel threshold 0.01, patience 2, cooldown 1):
    # the loss stops improving at epoch 4; more than 2 bad epochs (5, 6, 7) -> x 0.1 for epoch 8 on.
    opt = _sgd()
    s = getattr(sched, f"ReduceOnPlateau{form}")(opt, monitor="loss", factor=0.1, patience=2, cooldown=1,
                                                  threshold=0.01)
    metrics = [{"loss": v} for v in (10., 9., 8., 7., 6., 6., 6., 6., 6., 6.)]
    _close(_values(opt, [s], 10, key, metrics), [base] * 8 + [base * 0.1] * 2)
    with pytest.raises(KeyError, match="loss"):
        s.step({"acc": 1.0})
    with pytest.raises(TypeError, match="metrics type should be dict"):
        s.step([1.0])


def test_reduce_on_plateau_min_value_and_greater_rule():
    # min_value per group; rule greater, abs threshold 0.9 (MMEngine's cases).
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=0.05)
    s = sched.ReduceOnPlateauLR(opt, monitor="acc", rule="greater", threshold=0.9, threshold_rule="abs",
                                             patience=2, cooldown=1, min_value=[0.01, 0.0])
    metrics = [{"acc": v} for v in (1., 2., 3., 4., 5., 5., 5., 5., 5., 5.)]
    _values(opt, [s], 9, "lr", metrics)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.05])
    with pytest.raises(ValueError, match="expected 2 min_lrs"):
        sched.ReduceOnPlateauLR(opt, min_value=[0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match="by_epoch=True"):
        sched.ReduceOnPlateauLR(opt, by_epoch=False)
