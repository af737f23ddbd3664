"""VISSL's lr schedules: ClassyVision's values at hand-computed points, VISSL's auto_lr_scaling, and the
VisslLR scheduler setting schedule(where) at every step (iteration or epoch)."""

from __future__ import annotations

import math

import pytest
import torch

from memfit.config.vissl import auto_scale_schedule, check_schedule, schedule_value
from memfit.errors import ConfigError
from memfit.optim.scheduler import VisslLR, build_param_schedulers


def value(cfg: dict, where: float, num_epochs: int | None = None) -> float:
    return schedule_value(check_schedule(cfg, "lr", num_epochs), where)


@pytest.mark.parametrize("cfg, where, expected", [
    (dict(name="constant", value=0.1), 0.7, 0.1),
    (dict(name="linear", start_value=0.1, end_value=1.0), 0.25, 0.325),  # 1.0 * .25 + 0.1 * .75
    (dict(name="cosine", start_value=0.1, end_value=0.0), 0.5, 0.05),
    (dict(name="cosine", start_value=0.1, end_value=0.0), 0.25, 0.05 * (1 + math.sqrt(0.5))),
    (dict(name="cosine", start_value=0.1, end_value=0.001), 0.0, 0.1),
    (dict(name="polynomial", base_value=0.1, power=2.0), 0.5, 0.025),
    # multistep: milestones in epochs, epoch = int((where + 1e-6) * num_epochs)
    (dict(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60], num_epochs=90), 0.3333, 0.1),  # epoch 29
    (dict(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60], num_epochs=90), 1 / 3, 0.01),  # 30
    (dict(name="multistep", values=[0.1, 0.01, 0.001], milestones=[30, 60], num_epochs=90), 0.7, 0.001),  # 63
    # default milestones: every ceil(10 / 3) = 4 epochs
    (dict(name="multistep", values=[1.0, 0.1, 0.01], num_epochs=10), 0.35, 1.0),
    (dict(name="multistep", values=[1.0, 0.1, 0.01], num_epochs=10), 0.4, 0.1),
    (dict(name="multistep", values=[1.0, 0.1, 0.01], num_epochs=10), 0.85, 0.01),
    (dict(name="step", values=[1.0, 0.5, 0.25, 0.125], num_epochs=8), 0.3, 0.5),  # int(1.2)
    (dict(name="step", values=[1.0, 0.5, 0.25, 0.125], num_epochs=8), 0.74, 0.25),  # int(2.96)
    (dict(name="step_with_fixed_gamma", base_value=1.0, num_decays=3, gamma=0.1, num_epochs=8), 0.5, 0.01),
])
def test_schedule_values(cfg, where, expected):
    assert value(cfg, where) == pytest.approx(expected, rel=1e-12)


COMPOSITE = dict(name="composite", schedulers=[dict(name="linear", start_value=0.01, end_value=0.1),
                                               dict(name="cosine", start_value=0.1, end_value=0.0)],
                 lengths=[0.1, 0.9], interval_scaling=["rescaled", "fixed"], update_interval="step")


def test_composite_rescaled_and_fixed():
    assert value(COMPOSITE, 0.05) == pytest.approx(0.055)  # linear at its own where 0.5
    assert value(COMPOSITE, 0.0999995) == pytest.approx(0.05 * (1 + math.cos(math.pi * 0.0999995)))  # +1e-6 crosses
    assert value(COMPOSITE, 0.5) == pytest.approx(0.05)  # fixed: cosine at the global where
    rescaled = {**COMPOSITE, "interval_scaling": []}  # VISSL's default [] means rescaled for all
    assert value(rescaled, 0.55) == pytest.approx(0.05)  # cosine at (0.55 - 0.1) / 0.9 = 0.5
    # lengths within 1e-3 of 1 are accepted, the last one fixed up (ClassyVision)
    assert check_schedule({**COMPOSITE, "lengths": [0.1, 0.9004]}, "lr")["lengths"] == [0.1, 0.9]


@pytest.mark.parametrize("cfg, message", [
    (dict(name="cosinus", start_value=1, end_value=0), "lr.name='cosinus': not a VISSL/ClassyVision scheduler: did "
                                                       "you mean 'cosine'?"),
    (dict(name="cosine", start_value=1), "lr.end_value is required by the 'cosine' schedule"),
    (dict(name="multistep", values=[1, 0.1], milestones=[12], num_epochs=10), "lr.milestones=[12]: use increasing "
                                                                              "epochs in (0, num_epochs=10)"),
    ({**COMPOSITE, "lengths": [0.5, 0.6]}, "lr.lengths=[0.5, 0.6]: the shares of training must sum to 1"),
    ({**COMPOSITE, "update_interval": "iter"}, "lr.update_interval='iter': use 'step' or 'epoch'"),
    (dict(name="constant", value=0.1, velue=1), "lr.velue: not a key of VISSL's 'constant' schedule"),
])
def test_schedule_errors_name_the_key(cfg, message):
    with pytest.raises(ConfigError) as info:
        check_schedule(cfg, "lr")
    assert message in str(info.value)


def test_auto_lr_scaling_as_vissl():
    scale = dict(auto_scale=True, base_value=0.1, base_lr_batch_size=256)
    kw = dict(batch_size_per_replica=32, num_nodes=2, num_proc_per_node=8)  # global batch 512: x2
    cosine = auto_scale_schedule(dict(name="cosine", start_value=0.1, end_value=0.001, auto_lr_scaling=scale), **kw)
    assert cosine == dict(name="cosine", start_value=0.2, end_value=pytest.approx(0.002))
    multistep = auto_scale_schedule(dict(name="multistep", values=[0.1, 0.01, 0.001], auto_lr_scaling=scale), **kw)
    assert multistep["values"] == [0.2, 0.02, 0.002]
    sqrt = auto_scale_schedule(dict(name="constant", value=1.0,
                                    auto_lr_scaling={**scale, "scaling_type": "sqrt"}), **kw)
    assert sqrt["value"] == pytest.approx(0.1 * math.sqrt(2))
    warmup = dict(name="composite", lengths=[0.1, 0.9], interval_scaling=["rescaled", "rescaled"],
                  schedulers=[dict(name="linear", start_value=0.01, end_value=0.1),
                              dict(name="cosine", start_value=0.1, end_value=0.0)], auto_lr_scaling=scale)
    # two nodes: the warm-up runs from one node's lr (256 -> 0.1) to the global one (0.2)
    two = auto_scale_schedule(warmup, **kw)
    assert two["schedulers"] == [dict(name="linear", start_value=0.1, end_value=0.2),
                                 dict(name="cosine", start_value=0.2, end_value=0.0)]
    # one node: the warm-up would not rise, so VISSL drops it and the cosine is the whole schedule
    one = auto_scale_schedule(warmup, batch_size_per_replica=32, num_nodes=1, num_proc_per_node=8)
    assert check_schedule(one, "lr") == dict(name="cosine", start_value=0.1, end_value=0.0)
    off = auto_scale_schedule(dict(name="constant", value=1.0, auto_lr_scaling={**scale, "auto_scale": False}), **kw)
    assert off == dict(name="constant", value=1.0)


def _optimizer(*lrs: float) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0])


def test_vissl_lr_sets_schedule_of_where_every_iteration():
    opt = _optimizer(0.1, 0.05)  # a second group with half the lr keeps its ratio (paramwise lr_mult)
    sched = build_param_schedulers(dict(type="VisslLR", by_epoch=False, **COMPOSITE), opt, by_epoch_run=True,
                                   max_epochs=2, max_iters=20, epoch_length=10)[0]
    assert isinstance(sched, VisslLR)
    checked = check_schedule(COMPOSITE, "lr")
    seen = []
    for _ in range(20):
        seen.append([g["lr"] for g in opt.param_groups])
        sched.step()
    assert seen == [[schedule_value(checked, i / 20), schedule_value(checked, i / 20) / 2] for i in range(20)]


def test_vissl_lr_by_epoch_and_state():
    opt = _optimizer(0.1)
    lr = dict(name="multistep", values=[0.1, 0.01, 0.001], milestones=[2, 3], update_interval="epoch")
    sched = VisslLR(opt, **lr, end=4, by_epoch=True)  # num_epochs: the schedule's 4 epochs
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    assert seen == [0.1, 0.1, 0.01, 0.001]
    state = sched.state_dict()
    torch.save(state, "s.pth")
    assert torch.load("s.pth", weights_only=True) == state  # a checkpoint loads without unpickling code


def test_vissl_lr_errors():
    with pytest.raises(ConfigError, match=r"update_interval='step' needs by_epoch=False"):
        VisslLR(_optimizer(0.1), name="constant", value=0.1, update_interval="step", by_epoch=True, end=4)
    with pytest.raises(ConfigError, match=r"auto_lr_scaling.auto_scale=True: VisslLR takes the scaled values"):
        VisslLR(_optimizer(0.1), name="constant", value=0.1, auto_lr_scaling=dict(auto_scale=True), end=4)
    with pytest.raises(ConfigError, match=r"VisslLR needs the run's length"):
        VisslLR(_optimizer(0.1), name="constant", value=0.1)
