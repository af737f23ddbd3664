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
