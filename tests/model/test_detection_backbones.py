"""TimmBackbone: stage maps, MMDetection's frozen_stages/norm_eval, FrozenBN, local weights, checkpointing names."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from memfit.errors import ConfigError
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.registry import MODELS

TINY_SWIN = dict(type="TimmBackbone", model_name="swin_tiny_patch4_window7_224", embed_dim=32, depths=(1, 1, 1, 1),
                 num_heads=(1, 2, 4, 8), drop_path_rate=0.0)


def test_swin_stage_maps_at_any_size_divisible_by_32():
    torch.manual_seed(0)
    m = MODELS.build({**TINY_SWIN, "out_indices": (0, 1, 2, 3)})
    assert m.out_channels == [32, 64, 128, 256] and m.strides == [4, 8, 16, 32]
    for h, w in ((64, 96), (224, 224), (160, 352)):
        maps = m(torch.randn(1, 3, h, w))
        assert [tuple(f.shape) for f in maps] == [(1, c, h // s, w // s) for c, s in zip(m.out_channels, m.strides)]
    # Parameter names are timm's, so a timm checkpoint loads as it is.
    assert "layers.0.blocks.0.attn.qkv.weight" in dict(m.named_parameters())


def test_resnet_out_indices_count_from_stride_4_and_frozen_stages_as_mmdetection():
    m = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", out_indices=(1, 2, 3), frozen_stages=1))
    assert m.out_channels == [128, 256, 512] and m.strides == [8, 16, 32]
    trainable = {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"layer2", "layer3", "layer4"}  # the stem and layer1 are frozen
    stem_only = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", frozen_stages=0))
    assert {n.split(".")[0] for n, p in stem_only.named_parameters() if not p.requires_grad} == {"conv1", "bn1"}


def test_norm_eval_keeps_batchnorm_in_eval_and_frozen_bn_is_torchvisions():
    m = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", norm_eval=True))
    m.train()
    assert m.training and all(not b.training for b in m.modules() if isinstance(b, nn.BatchNorm2d))
    frozen = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", frozen_bn=True))
    assert not any(isinstance(b, nn.BatchNorm2d) for b in frozen.modules())
    assert sum(isinstance(b, FrozenBatchNorm2d) for b in frozen.modules()) == 20


def test_frozen_bn_computes_what_eval_batchnorm_does():
    torch.manual_seed(0)
    m = MODELS.build(dict(type="TimmBackbone", model_name="resnet18"))
    with torch.no_grad():
        for b in m.modules():
            if isinstance(b, nn.BatchNorm2d):
                b.running_mean.normal_(0, 0.1)
                b.running_var.uniform_(0.5, 1.5)
    state = m.state_dict()
    frozen = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", frozen_bn=True))
    frozen.load_state_dict({k: v for k, v in state.items() if "num_batches_tracked" not in k})
    x = torch.randn(2, 3, 64, 64)
    for a, b in zip(m.eval()(x), frozen(x)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_pretrained_from_a_local_file(tmp_path):
    torch.manual_seed(1)
    source = MODELS.build(dict(type="TimmBackbone", model_name="resnet18"))
    path = tmp_path / "r18.pth"
    torch.save(source.state_dict(), path)
    loaded = MODELS.build(dict(type="TimmBackbone", model_name="resnet18", pretrained=str(path)))
    for (n, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


def test_init_cfg_pretrained_loads_when_the_model_initialises(tmp_path):
    from memfit.model.init import init_model_weights

    torch.manual_seed(2)
    source = MODELS.build(dict(type="TimmBackbone", model_name="resnet18"))
    torch.save(source.state_dict(), tmp_path / "r18.pth")
    detector = MODELS.build(dict(type="FCOS", num_classes=2, out_channels=32, backbone=dict(
        model_name="resnet18", init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / "r18.pth")))))
    assert not torch.equal(detector.backbone.body.conv1.weight, source.conv1.weight)
    assert "backbone.body" in init_model_weights(detector)
    for (n, a), b in zip(source.state_dict().items(), detector.backbone.body.state_dict().values()):
        assert torch.equal(a, b), n


def test_backbone_layers_checkpoints_each_swin_stage_exactly():
    torch.manual_seed(0)
    plain = MODELS.build({**TINY_SWIN, "out_indices": (1, 2, 3)})
    torch.manual_seed(0)
    cp = MODELS.build({**TINY_SWIN, "out_indices": (1, 2, 3)})
    assert apply_activation_checkpointing(cp, ["layers"]) == [f"layers.{i}" for i in range(4)]
    x = torch.randn(2, 3, 64, 64)
    for model in (plain, cp):
        sum(f.square().mean() for f in model(x)).backward()
    grads = [(n, a.grad, b.grad) for (n, a), b in zip(plain.named_parameters(), cp.parameters())]
    assert sum(a is not None for _, a, _ in grads) > 20
    for n, a, b in grads:
        assert (a is None and b is None) or torch.equal(a, b), n


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (dict(model_name="resnet_18"), "unknown timm model 'resnet_18'"),
        (dict(model_name="resnet18", out_indices=(0, 4)), "out_indices=(0, 4)"),
        (dict(model_name="resnet18", frozen_stages=5), "frozen_stages=5"),
        (dict(model_name="resnet18", drop_path_rate=1.5), "backbone.drop_path_rate=1.5: use a probability"),
    ],
)
def test_bad_backbone_configs_are_one_line_errors(cfg, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        MODELS.build(dict(type="TimmBackbone", **cfg))
