"""Param-wise options: decay multipliers, lr multipliers by name, merging, errors, optimizer round trip."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError, ConfigTypeError
from memfit.optim.param_groups import build_param_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, groups=8))
        self.backbone.add_module("norm", nn.LayerNorm(8))
        self.neck = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.pos_embed = nn.Parameter(torch.zeros(1, 8))


def _by_name(groups: list[dict]) -> dict[str, dict]:
    return {n: g for g in groups for n in g["param_names"]}


def test_norm_and_bias_decay_and_backbone_lr() -> None:
    cfg = dict(norm_decay_mult=0.0, bias_decay_mult=0.0, custom_keys={"head": dict(lr_mult=0.1)})
    groups = build_param_groups(Net(), lr=1.0, weight_decay=0.05, paramwise_cfg=cfg)
    g = _by_name(groups)
    assert g["backbone.1.weight"]["weight_decay"] == 0.0  # BatchNorm
    assert g["backbone.norm.bias"]["weight_decay"] == 0.0  # LayerNorm
    assert g["neck.bias"]["weight_decay"] == 0.0
    assert g["neck.weight"]["weight_decay"] == 0.05 and g["neck.weight"]["lr"] == 1.0
    assert g["backbone.0.weight"]["weight_decay"] == 0.05
    # custom key wins over the bias rule: head.bias keeps weight decay, lr is scaled.
    assert g["head.bias"] == g["head.weight"]
    assert g["head.bias"]["lr"] == pytest.approx(0.1) and g["head.bias"]["weight_decay"] == 0.05
    # Equal options share one group: {wd 0.05}, {wd 0}, {head}.
    assert len(groups) == 3
    names = sorted(n for grp in groups for n in grp["param_names"])
    assert names == sorted(n for n, _ in Net().named_parameters())


def test_longest_custom_key_wins_and_extra_options_pass_through() -> None:
    cfg = dict(custom_keys={
        "backbone": dict(lr_mult=0.1),
        "backbone.norm": dict(lr_mult=0.5, decay_mult=0.0, betas=(0.8, 0.9)),
        "embed": dict(decay_mult=0.0),
    })
    g = _by_name(build_param_groups(Net(), lr=2.0, weight_decay=0.1, paramwise_cfg=cfg))
    assert g["backbone.0.weight"]["lr"] == pytest.approx(0.2)
    assert g["backbone.norm.weight"]["lr"] == pytest.approx(1.0)
    norm_w = g["backbone.norm.weight"]
    assert norm_w["weight_decay"] == 0.0 and norm_w["betas"] == (0.8, 0.9)
    assert g["pos_embed"]["weight_decay"] == 0.0 and g["pos_embed"]["lr"] == 2.0
    assert "betas" not in g["neck.weight"]


def test_dwconv_flat_and_bias_lr_mult() -> None:
    cfg = dict(dwconv_decay_mult=0.5, flat_decay_mult=0.0, bias_lr_mult=2.0)
    g = _by_name(build_param_groups(Net(), lr=1.0, weight_decay=0.1, paramwise_cfg=cfg))
    assert g["backbone.2.weight"]["weight_decay"] == pytest.approx(0.05)  # depth-wise conv
    assert g["backbone.1.weight"]["weight_decay"] == 0.0  # 1-D (no norm rule given)
    assert g["neck.bias"]["lr"] == 2.0 and g["backbone.1.bias"]["lr"] == 1.0  # norm bias: no bias_lr_mult


def test_frozen_params_excluded_and_no_weight_decay() -> None:
    net = Net()
    net.backbone.requires_grad_(False)
    groups = build_param_groups(net, lr=1.0, weight_decay=None, paramwise_cfg=dict(norm_decay_mult=0.0))
    names = [n for grp in groups for n in grp["param_names"]]
    assert not any(n.startswith("backbone") for n in names) and "neck.weight" in names
    assert len(groups) == 1 and "weight_decay" not in groups[0]


def test_errors_and_warnings(caplog: pytest.LogCaptureFixture) -> None:
    build = functools.partial(build_param_groups, Net(), lr=1.0, weight_decay=0.1)
    with pytest.raises(ConfigError, match="unknown key 'norm_decay_mul'.*did you mean 'norm_decay_mult'"):
        build_param_groups(Net(), lr=1.0, weight_decay=0.1, paramwise_cfg=dict(norm_decay_mul=0.0))
    with pytest.raises(ConfigError, match=r"custom_keys\['head'\]: unknown key 'lr_mul'"):
        build(paramwise_cfg=dict(custom_keys={"head": {"lr_mul": 1}}))
    with pytest.raises(ConfigError, match="dcn_offset_lr_mult.*conv_offset"):
        build_param_groups(Net(), lr=1.0, weight_decay=0.1, paramwise_cfg=dict(dcn_offset_lr_mult=0.1))
    with pytest.raises(ConfigError, match=r"^paramwise_cfg\.custom_keys\['head'\]\.lr_mult=-1: use a number >= 0"):
        build(paramwise_cfg=dict(custom_keys={"head": {"lr_mult": -1}}))  # torch would take a negative group lr
    with pytest.raises(ConfigError, match=r"^paramwise_cfg\.norm_decay_mult=-0\.5: use a number >= 0"):
        build(paramwise_cfg=dict(norm_decay_mult=-0.5))
    with pytest.raises(ConfigTypeError, match=r"^paramwise_cfg\.bias_lr_mult='x': use a number$"):
        build(paramwise_cfg=dict(bias_lr_mult="x"))
    groups = build(paramwise_cfg=dict(custom_keys={"head": {"lr_mult": 0}}))  # 0 freezes: allowed
    assert any(g["lr"] == 0 for g in groups)
    with caplog.at_level(logging.WARNING, logger="memfit"):
        build(paramwise_cfg=dict(custom_keys={"absolute_pos": {}}))
    assert "custom_keys['absolute_pos'] matches no trainable parameter" in caplog.text


def test_tied_weights_need_bypass_duplicate() -> None:
    net = Net()
    net.head = nn.Linear(8, 8)  # tie neck and head weights
    net.head.weight = net.neck.weight
    with pytest.raises(ConfigError, match="'head.weight' is the same tensor as 'neck.weight'.*bypass_dupl"):
        build_param_groups(net, lr=1.0, weight_decay=0.1, paramwise_cfg=None)
    groups = build_param_groups(net, lr=1.0, weight_decay=0.1, paramwise_cfg=dict(bypass_duplicate=True))
    names = [n for grp in groups for n in grp["param_names"]]
    assert "neck.weight" in names and "head.weight" not in names


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW], ids=["SGD", "AdamW"])
def test_groups_work_with_optimizers_schedulers_and_state_dict(opt_cls: type) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    cfg = dict(norm_decay_mult=0.0, custom_keys={"2.": dict(lr_mult=0.5)})
    opt = opt_cls(build_param_groups(net, lr=0.1, weight_decay=0.01, paramwise_cfg=cfg), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # scales each group's own lr
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([0.025, 0.05, 0.05])
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    state = opt.state_dict()
    assert [g["param_names"] for g in state["param_groups"]] == [g["param_names"] for g in opt.param_groups]
    fresh = opt_cls(build_param_groups(net, lr=0.1, weight_decay=0.01, paramwise_cfg=cfg), lr=0.1)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["param_groups"] == state["param_groups"]
    for k, v in state["state"].items():
        for name, t in v.items():
            torch.testing.assert_close(fresh.state_dict()["state"][k][name], t)
