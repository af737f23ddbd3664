"""An optim_wrapper read before it is built (the connector's checks, the planner) gives the values, and the
errors, that building it gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError, ConfigTypeError
from memfit.optim.spec import OptimWrapperSpec
from memfit.optim.wrapper import OptimWrapper
from memfit.planner.space import ModelFacts, configured_plan

SGD = dict(type="SGD", lr=0.1)


def test_a_config_is_read_once_with_the_wrappers_checks():
    spec = OptimWrapperSpec.of(dict(type="AmpOptimWrapper", optimizer=dict(SGD, fused=True), accumulative_counts=4,
                                    clip_grad=dict(max_norm=1.0, type="norm")))
    assert spec == OptimWrapperSpec("AmpOptimWrapper", 4, dict(max_norm=1.0), dict(SGD, fused=True), False)
    assert spec.fused
    assert OptimWrapperSpec.of(None) == OptimWrapperSpec()
    several = OptimWrapperSpec.of(dict(generator=dict(optimizer=SGD), discriminator=dict(optimizer=SGD)))
    assert several.several and several.accumulative_counts == 1
    built = OptimWrapper(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), 3, dict(max_norm=2.0))
    assert OptimWrapperSpec.of(built) == OptimWrapperSpec("OptimWrapper", 3, dict(max_norm=2.0))


@pytest.mark.parametrize("key, value, error, message", [
    ("accumulative_counts", "four", ConfigTypeError, "optim_wrapper.accumulative_counts='four': use an int >= 1"),
    ("accumulative_counts", 0, ValueError, "optim_wrapper.accumulative_counts=0: use an int >= 1"),
    ("clip_grad", dict(norm=1.0), ConfigError, "optim_wrapper.clip_grad={'norm': 1.0}: use dict(max_norm="),
])
def test_read_early_or_built_a_bad_value_is_the_same_one_line(key, value, error, message):
    cfg = dict(optimizer=SGD, **{key: value})
    with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")) as early:
        OptimWrapperSpec.of(cfg)
    with pytest.raises(error) as built:
        OptimWrapper(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), **{key: value})
    assert str(early.value) == str(built.value)
    facts = ModelFacts(block_types=(), blocks=(), stages=(), frozen_bn=False)
    with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):  # the planner reads it first
        configured_plan(dict(optim_wrapper=cfg, train_dataloader=dict(batch_size=2)), facts)
