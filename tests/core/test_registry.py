"""Registries: names, dotted paths, torchvision builders, and errors with suggestions."""

import pytest
import torch

from memfit.errors import ConfigError
from memfit.registry import MODELS, OPTIMIZERS, Registry


def test_build_by_name_class_and_dotted_path():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert type(OPTIMIZERS.build(dict(type="AdamW", lr=1e-3), params=params)) is torch.optim.AdamW
    assert type(OPTIMIZERS.build(dict(type=torch.optim.SGD, lr=0.1), params=params)) is torch.optim.SGD
    assert type(OPTIMIZERS.build(dict(type="torch.optim.RMSprop", lr=0.1), params=params)) is torch.optim.RMSprop
    assert "Lars" in OPTIMIZERS and "Larc" in OPTIMIZERS


def test_torchvision_models_are_registered():
    model = MODELS.build(dict(type="resnet18", num_classes=3))
    assert model.fc.out_features == 3


def test_unknown_name_and_key_suggest_the_nearest():
    with pytest.raises(ConfigError, match="did you mean 'AdamW'"):
        OPTIMIZERS.get("AdamW_")
    with pytest.raises(ConfigError, match="unknown key 'l_r': did you mean 'lr'"):
        OPTIMIZERS.build(dict(type="SGD", l_r=0.1), params=[torch.nn.Parameter(torch.zeros(1))])
    reg = Registry("thing")
    reg.register(int)
    with pytest.raises(KeyError):
        reg.register(float, name="int")
