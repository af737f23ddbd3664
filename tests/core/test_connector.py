"""The connector: one precision per run from the wrapper and the strategy, bad pairs refused in one
line, the set-up order (techniques, precision conversion, wrap, optimizer), evaluation precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.connector import select_precision, setup
from memfit.errors import ConfigError
from memfit.model import BaseModel
from memfit.precision import AutocastPrecision, HalfPrecision, Precision
from memfit.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

SGD = dict(optimizer=dict(type="SGD", lr=0.1))


def test_precision_from_the_wrapper_or_the_strategy():
    assert type(select_precision(SGD, SingleDeviceStrategy())) is Precision
    p = select_precision(dict(SGD, type="AmpOptimWrapper", dtype="float16", loss_scale=64.0), SingleDeviceStrategy())
    assert isinstance(p, AutocastPrecision) and p.dtype is torch.float16 and p.scaler is not None
    p = select_precision(SGD, FSDPStrategy(mixed_precision=dict(param_dtype="bfloat16", reduce_dtype="float32")))
    assert isinstance(p, HalfPrecision) and p.fsdp_policy_kwargs()["reduce_dtype"] is torch.float32
    s = FSDPStrategy()
    select_precision(dict(SGD, type="AmpOptimWrapper", dtype="bfloat16"), s)
    assert s.precision.name == "bf16-mixed"  # handed to the strategy


@pytest.mark.parametrize("wrapper, strategy, match", [
    (dict(SGD, type="AmpOptimWrapper"), lambda: FSDPStrategy(mixed_precision=dict(param_dtype="bfloat16")),
     "two precisions"),
    (dict(SGD, type="AmpOptimWrapper", dtype="fp8"), SingleDeviceStrategy, "optim_wrapper.dtype='fp8'"),
    (dict(SGD, type="AmpOptimWrapper", loss_scale="static"), SingleDeviceStrategy, "loss_scale='static'"),
])
def test_bad_combinations_are_one_line_errors(wrapper, strategy, match):
    with pytest.raises(ConfigError, match=match) as err:
        select_precision(wrapper, strategy())
    assert "\n" not in str(err.value)


def test_whole_model_half_is_refused_where_the_backend_has_none():
    strategy = DDPStrategy()
    strategy.precision_request = lambda: HalfPrecision(torch.bfloat16)
    with pytest.raises(ConfigError, match="no whole-model bf16-true mode"):
        select_precision(SGD, strategy)


def test_optimizer_in_backward_only_on_one_device():
    with pytest.raises(ConfigError, match="one process on one device"):
        setup(nn.Linear(2, 2), DDPStrategy(), SGD, optimizer_in_backward=True)


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.GELU())
        self.head = nn.Linear(8, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, x, mode="tensor"):
        out = self.head(self.stem(x))
        self.seen.append(out.dtype)
        return {"loss": out.float().square().mean()} if mode == "loss" else out


def test_setup_applies_techniques_and_islands_before_building_the_optimizer():
    model, wrapper = setup(Net(), SingleDeviceStrategy(),
                           dict(SGD, type="AmpOptimWrapper", dtype="bfloat16", fp32_modules=["head"]),
                           dict(activation_checkpointing=["stem"]))
    model.train_step((torch.randn(3, 4),), wrapper)
    assert model.seen == [torch.float32]  # the head is an fp32 island under bf16 autocast
    assert "forward" in model.stem.__dict__  # checkpointed in place
    assert wrapper.strategy.precision.dtype is torch.bfloat16
    assert {id(p) for p in model.parameters()} == {id(p) for g in wrapper.param_groups for p in g["params"]}


def test_evaluation_runs_fp32_unless_the_loop_asks_for_half():
    model, wrapper = setup(Net(), SingleDeviceStrategy(), dict(SGD, type="AmpOptimWrapper", dtype="bfloat16"))
    precision, device = wrapper.strategy.precision, wrapper.strategy.device
    with torch.no_grad(), precision.eval_autocast(False):
        model(torch.randn(1, 4, device=device))
    with torch.no_grad(), precision.eval_autocast(True):
        model(torch.randn(1, 4, device=device))
    assert model.seen == [torch.float32, torch.bfloat16]
