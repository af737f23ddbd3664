"""LARC/LARS: one step against a hand computation of Apex's LARC update, and registry building."""

from __future__ import annotations

import math

import pytest
import torch

from memfit.errors import ConfigError
from memfit.optim.larc import Larc
from memfit.registry import OPTIMIZERS


def _one_step(opt_cfg: dict, w: list[float], g: list[float]) -> torch.Tensor:
    p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
    opt = OPTIMIZERS.build(opt_cfg, params=[p])
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    return p.detach()


def _hand(w: list[float], g: list[float], lr: float, coeff: float, wd: float, clip: bool) -> list[float]:
    """Apex LARC: ratio = coeff*|w|/(|g| + wd*|w| + eps); clip: min(ratio/lr, 1); w -= lr*ratio*(g + wd*w)."""
    wn, gn = math.hypot(*w), math.hypot(*g)
    ratio = coeff * wn / (gn + wd * wn + 1e-8)
    if clip:
        ratio = min(ratio / lr, 1.0)
    return [wi - lr * ratio * (gi + wd * wi) for wi, gi in zip(w, g)]


@pytest.mark.parametrize(
    "lr, coeff", [(0.1, 0.02), (0.1, 0.5)], ids=["ratio-below-1", "ratio-clipped-to-1"]
)
def test_larc_step_matches_hand_computation(lr: float, coeff: float) -> None:
    w, g, wd = [3.0, 4.0], [0.6, 0.8], 0.01
    got = _one_step(dict(type="Larc", lr=lr, momentum=0.9, trust_coeff=coeff, weight_decay=wd), w, g)
    torch.testing.assert_close(got, torch.tensor(_hand(w, g, lr, coeff, wd, clip=True), dtype=torch.float64))


def test_lars_without_clip_matches_hand_computation() -> None:
    w, g = [3.0, 4.0], [0.6, 0.8]
    got = _one_step(dict(type="Lars", lr=0.1, trust_coeff=0.02, weight_decay=0.01), w, g)
    want = _hand(w, g, 0.1, 0.02, 0.01, clip=False)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


def test_larc_adapts_params_without_weight_decay() -> None:
    # Apex LARC adapts every parameter; timm's Lars alone would skip groups with weight_decay=0.
    w, g = [3.0, 4.0], [0.6, 0.8]
    got = _one_step(dict(type="Larc", lr=0.1, trust_coeff=0.02), w, g)
    torch.testing.assert_close(got, torch.tensor(_hand(w, g, 0.1, 0.02, 0.0, clip=True), dtype=torch.float64))


def test_vissl_aliases_and_conflicts() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = Larc([p], lr=0.1, clip=False, trust_coefficient=0.005)
    assert opt.param_groups[0]["trust_clip"] is False and opt.param_groups[0]["trust_coeff"] == 0.005
    with pytest.raises(ConfigError, match="'trust_coeff' or its VISSL alias 'trust_coefficient'"):
        Larc([p], trust_coeff=0.1, trust_coefficient=0.1)
    with pytest.raises(ConfigError, match="did you mean 'trust_coeff'"):
        OPTIMIZERS.build(dict(type="Larc", lr=0.1, trust_coef=0.1), params=[p])


class ApexLARC:
    """NVIDIA Apex's ``apex/parallel/LARC.py`` step, line for line, around a torch SGD (VISSL wraps it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float, clip: bool, eps: float) -> None:
        self.optim, self.trust_coefficient, self.clip, self.eps = optimizer, trust_coefficient, clip, eps

    def step(self) -> None:
        with torch.no_grad():
            weight_decays = []
            for group in self.optim.param_groups:
                weight_decay = group["weight_decay"] if "weight_decay" in group else 0
                weight_decays.append(weight_decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm = torch.norm(p.data)
                    grad_norm = torch.norm(p.grad.data)
                    if param_norm != 0 and grad_norm != 0:
                        adaptive_lr = self.trust_coefficient * param_norm / (
                            grad_norm + param_norm * weight_decay + self.eps)
                        if self.clip:
                            adaptive_lr = min(adaptive_lr / group["lr"], 1)
                        p.grad.data += weight_decay * p.data
                        p.grad.data *= adaptive_lr
        self.optim.step()
        for i, group in enumerate(self.optim.param_groups):
            group["weight_decay"] = weight_decays[i]


@pytest.mark.parametrize("clip", [False, True], ids=["vissl-clip-False", "clip-True"])
def test_larc_steps_equal_apex_larc_around_sgd(clip: bool) -> None:
    """VISSL's larc_config (clip=False, trust_coefficient=0.001, eps=1e-8) with SGD momentum 0.9 and
    weight decay 1e-6: three steps of memfit's Larc equal Apex's LARC around torch's SGD, parameter by
    parameter, momentum included (float64, rtol 1e-12). clip=True uses a large trust coefficient so
    that some ratios are clipped to 1 and others are not."""
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2, 3)]
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, dtype=torch.float64) * 10 ** (1 - i) for i, s in enumerate(shapes)] for _ in range(3)]
    coeff = 0.001 if not clip else 0.2
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    theirs = [torch.nn.Parameter(w.clone()) for w in init]
    opt = OPTIMIZERS.build(dict(type="Larc", lr=0.1, momentum=0.9, weight_decay=1e-6, clip=clip,
                                trust_coefficient=coeff, eps=1e-8), params=ours)
    apex = ApexLARC(torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=1e-6), coeff, clip, 1e-8)
    for step_grads in grads:
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        apex.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
    assert all(not torch.equal(p, w) for p, w in zip(ours, init))
