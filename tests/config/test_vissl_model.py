"""VisslModel: VISSL's trunks as one nn.Sequential of VISSL's stages, its mlp / eval_mlp heads and its
cross-entropy loss (with temperature and L2-normalised outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import ConfigError
from memfit.model import VisslModel
from memfit.model.vissl import build_trunk, eval_mlp_head, mlp_head

VIT = dict(name="vision_transformer", image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64)


def test_resnet_trunk_is_vissls_feature_blocks():
    trunk = build_trunk(dict(name="resnet", depth=18, width_multiplier=2))
    assert isinstance(trunk, nn.Sequential)
    assert [n for n, _ in trunk.named_children()] == ["conv1", "bn1", "conv1_relu", "maxpool", "layer1", "layer2",
                                                      "layer3", "layer4", "avgpool", "flatten"]
    assert trunk.conv1.out_channels == 128  # 64 x width_multiplier
    assert trunk(torch.randn(2, 3, 32, 32)).shape == (2, 1024)
    gn = build_trunk(dict(name="resnet", depth=18, norm="GroupNorm", groupnorm_groups=8, layer4_stride=1))
    assert isinstance(gn.bn1, nn.GroupNorm) and gn.bn1.num_groups == 8


def test_regnet_trunk_by_parameters_and_by_name():
    trunk = build_trunk(dict(name="regnet", depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8))
    names = [n for n, _ in trunk.named_children()]
    assert names[0] == "stem" and names[-2:] == ["avgpool", "flatten"] and names[1].startswith("block")
    assert trunk(torch.randn(2, 3, 32, 32)).ndim == 2
    named = build_trunk(dict(name="regnet", regnet_name="regnet_y_400mf"))  # VISSL also spells it regnet_y_0.4gf
    assert named(torch.randn(2, 3, 32, 32)).shape == (2, 440)
    with pytest.raises(ConfigError, match=r"model.trunk.name='regnet_y_4mf': not a RegNet"):
        build_trunk(dict(name="regnet", regnet_name="regnet_y_4mf"))


def test_vit_trunk_stages_and_parameter_names():
    trunk = build_trunk(VIT)
    assert [n for n, _ in trunk.named_children()] == ["embed", "block0", "block1", "block2", "norm", "pool"]
    assert trunk(torch.randn(2, 3, 32, 32)).shape == (2, 32)
    names = dict(trunk.named_parameters())
    assert "embed.class_token" in names and "embed.pos_embedding" in names  # VISSL's non_regularized_parameters
    gap = build_trunk({**VIT, "classifier": "gap"})
    assert gap(torch.randn(2, 3, 32, 32)).shape == (2, 32)


def test_trunk_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.trunk: unknown key 'dept': did you mean 'depth'"):
        build_trunk(dict(name="resnet", dept=18))
    with pytest.raises(ConfigError, match=r"model.trunk.depth=19: use one of \[18, 34, 50, 101, 152, 200\]"):
        build_trunk(dict(name="resnet", depth=19))
    with pytest.raises(ConfigError, match=r"model.trunk.name='alexnet'"):
        build_trunk(dict(name="alexnet"))


def test_heads_as_vissl_builds_them():
    mlp = mlp_head([32, 16, 4], use_bn=True, use_relu=True)
    assert [type(m) for m in mlp] == [nn.Flatten, nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]  # none after the last
    full = mlp_head([32, 4], use_relu=True, skip_last_layer_relu_bn=False)
    assert [type(m) for m in full] == [nn.Flatten, nn.Linear, nn.ReLU]
    ev = eval_mlp_head(32, [32, 4], bn_eps=1e-3)
    assert isinstance(ev[1], nn.BatchNorm2d) and ev[1].eps == 1e-3
    assert ev(torch.randn(3, 32)).shape == (3, 4)


def test_model_loss_and_predict():
    torch.manual_seed(0)
    model = VisslModel(trunk=VIT, heads=[["mlp", {"dims": [32, 4]}]], head_params_multiplier=0.5,
                       loss=dict(name="cross_entropy_multiple_output_single_target", temperature=0.1,
                                 normalize_output=True))
    img, label = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, -1])  # -1: VISSL's ignore_index
    out = model(img, mode="tensor")
    expected = F.cross_entropy(F.normalize(out, dim=1) / 0.1, label, ignore_index=-1)
    torch.testing.assert_close(model(img, label, mode="loss")["loss"], expected)
    scores, labels = model(img, label, mode="predict")
    assert scores.shape == (4, 4) and torch.allclose(scores.sum(-1), torch.ones(4)) and labels is label
    ce = VisslModel(trunk=VIT, heads=[["mlp", {"dims": [32, 4]}]],
                    loss=dict(name="CrossEntropyLoss", ignore_index=-1, label_smoothing=0.1))
    out = ce(img, mode="tensor")
    torch.testing.assert_close(ce(img, label, mode="loss")["loss"],
                               F.cross_entropy(out, label, ignore_index=-1, label_smoothing=0.1))
    with pytest.raises(ConfigError, match=r"model.loss.temprature: not an option of"):
        VisslModel(trunk=VIT, loss=dict(name="cross_entropy_multiple_output_single_target", temprature=1.0))
    with pytest.raises(ConfigError, match=r"model.heads\[0\] \(mlp\): unknown key 'dim'"):
        VisslModel(trunk=VIT, heads=[["mlp", {"dim": [32, 4]}]])
