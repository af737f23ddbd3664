"""``VisslModel``: VISSL's trunk + heads classifier, built from a translated VISSL config.

The trunk is one ``nn.Sequential`` (so ``cfg.activation_checkpointing=dict(splits=N, module='trunk')``
cuts it into N segments as VISSL's ``NUM_ACTIVATION_CHECKPOINTING_SPLITS`` does), with VISSL's
stages as its children:

- ``resnet``: torchvision's ResNet blocks at VISSL's widths (``64 * width_multiplier``):
  conv1, bn1, conv1_relu, maxpool, layer1..layer4, avgpool, flatten;
- ``regnet``: torchvision's RegNet by ``regnet_name`` (``regnet_y_400mf``, VISSL's ``regnet_y_1.6gf``
  spelling too) or by ClassyVision's parameters: stem, block1..block4, avgpool, flatten;
- ``vision_transformer``: patch embedding with class token and position embedding, timm
  transformer blocks (pre-norm, LayerNorm eps 1e-6), final norm, and the class token (or the mean
  of the patch tokens for ``classifier='gap'``).

Heads run in order on the trunk's features: ``mlp`` (Linear [-> BN] [-> ReLU] [-> Dropout] per
pair of ``dims``) and ``eval_mlp`` (BatchNorm2d on the features, then an mlp). The loss is VISSL's
``cross_entropy_multiple_output_single_target`` (optionally L2-normalised logits over a
temperature) or ``CrossEntropyLoss``; ``predict`` returns ``(softmax scores, labels)`` for Accuracy.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import ConfigError, did_you_mean
from memfit.model.base import BaseModel
from memfit.registry import MODELS, check_kwargs

RESNET_BLOCKS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3)),
                 101: ("bottleneck", (3, 4, 23, 3)), 152: ("bottleneck", (3, 8, 36, 3)),
                 200: ("bottleneck", (3, 24, 36, 3))}


def resnet_trunk(depth: int = 50, width_multiplier: int = 1, norm: str = "BatchNorm", groupnorm_groups: int = 32,
                 groups: int = 1, width_per_group: int = 64, zero_init_residual: bool = False,
                 layer4_stride: int = 2) -> nn.Sequential:
    """VISSL's ResNeXt trunk: torchvision blocks, every width times ``width_multiplier``."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    if depth not in RESNET_BLOCKS:
        raise ConfigError(f"model.trunk.depth={depth!r}: use one of {sorted(RESNET_BLOCKS)}")
    if layer4_stride not in (1, 2):
        raise ConfigError(f"model.trunk.layer4_stride={layer4_stride!r}: use 1 or 2")
    if norm == "BatchNorm":
        norm_layer: Any = nn.BatchNorm2d
    elif norm == "GroupNorm":
        norm_layer = partial(nn.GroupNorm, groupnorm_groups)
    else:
        raise ConfigError(f"model.trunk.norm={norm!r}: use 'BatchNorm' or 'GroupNorm'")
    kind, layers = RESNET_BLOCKS[depth]
    block = BasicBlock if kind == "basic" else Bottleneck
    net = ResNet(block, list(layers), zero_init_residual=zero_init_residual, groups=groups,
                 width_per_group=width_per_group, norm_layer=norm_layer)
    width = 64 * int(width_multiplier)
    net.inplanes = width
    # conv1_relu is not in-place: a checkpointed segment may start with it, and non-reentrant
    # checkpointing refuses a segment that overwrites its saved input.
    trunk = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False), bn1=norm_layer(width),
        conv1_relu=nn.ReLU(), maxpool=nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        layer1=net._make_layer(block, width, layers[0]), layer2=net._make_layer(block, width * 2, layers[1], stride=2),
        layer3=net._make_layer(block, width * 4, layers[2], stride=2),
        layer4=net._make_layer(block, width * 8, layers[3], stride=layer4_stride),
        avgpool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(1)))
    for m in trunk.modules():  # torchvision's initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in trunk.modules():
            last = getattr(m, "bn3", None) if isinstance(m, Bottleneck) else getattr(m, "bn2", None)
            if isinstance(m, (BasicBlock, Bottleneck)) and last is not None and last.weight is not None:
                nn.init.zeros_(last.weight)
    return trunk


def regnet_trunk(name: str | None = None, depth: int | None = None, w_0: int | None = None, w_a: float | None = None,
                 w_m: float | None = None, group_width: int | None = None, bottleneck_multiplier: float = 1.0,
                 use_se: bool = True, se_ratio: float = 0.25, stem_width: int = 32, bn_epsilon: float = 1e-5,
                 bn_momentum: float = 0.1) -> nn.Sequential:
    """A RegNet by torchvision name, or from ClassyVision's parameters (RegNetY unless ``use_se=False``)."""
    import torchvision.models as tvm
    from torchvision.models.regnet import BlockParams, RegNet

    norm = partial(nn.BatchNorm2d, eps=bn_epsilon, momentum=bn_momentum)
    if name is not None:
        tv_name = str(name).replace(".", "_")
        names = [n for n in dir(tvm) if n.startswith("regnet_")]
        if tv_name not in names:
            raise ConfigError(f"model.trunk.name={name!r}: not a RegNet: {did_you_mean(tv_name, names)}")
        net = getattr(tvm, tv_name)(weights=None, norm_layer=norm)
    else:
        missing = [k for k, v in dict(depth=depth, w_0=w_0, w_a=w_a, w_m=w_m, group_width=group_width).items()
                   if v is None]
        if missing:
            raise ConfigError(f"model.trunk: a RegNet needs a name or depth, w_0, w_a, w_m, group_width "
                              f"({', '.join(missing)} missing)")
        params = BlockParams.from_init_params(depth=depth, w_0=w_0, w_a=w_a, w_m=w_m, group_width=group_width,
                                              bottleneck_multiplier=bottleneck_multiplier,
                                              se_ratio=se_ratio if use_se else None)
        net = RegNet(params, stem_width=stem_width, norm_layer=norm)
    stages = OrderedDict(stem=net.stem)
    stages.update(net.trunk_output.named_children())
    stages.update(avgpool=net.avgpool, flatten=nn.Flatten(1))
    return nn.Sequential(stages)


class _VitEmbed(nn.Module):
    """Patches -> tokens, the class token in front, plus the position embedding (VISSL's names)."""

    def __init__(self, image_size: int, patch_size: int, hidden_dim: int, dropout_rate: float) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ConfigError(f"model.trunk: image_size={image_size} is not a multiple of patch_size={patch_size}")
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, (image_size // patch_size) ** 2 + 1, hidden_dim))
        self.dropout = nn.Dropout(dropout_rate)
        nn.init.trunc_normal_(self.pos_embedding, std=0.02)
        nn.init.trunc_normal_(self.class_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class _TokenPool(nn.Module):
    def __init__(self, classifier: str) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] if self.classifier == "token" else x[:, 1:].mean(dim=1)


def vit_trunk(image_size: int = 224, patch_size: int = 16, num_layers: int = 12, num_heads: int = 12,
              hidden_dim: int = 768, mlp_dim: int = 3072, dropout_rate: float = 0.0,
              attention_dropout_rate: float = 0.0, drop_path_rate: float = 0.0, classifier: str = "token",
              qkv_bias: bool = False) -> nn.Sequential:
    """VISSL's vision transformer from timm's blocks: embed, block0..blockN-1, norm, pool."""
    from timm.models.vision_transformer import Block

    if classifier not in ("token", "gap"):
        raise ConfigError(f"model.trunk.classifier={classifier!r}: use 'token' or 'gap'")
    if int(hidden_dim * (mlp_dim / hidden_dim)) != mlp_dim:
        raise ConfigError(f"model.trunk.mlp_dim={mlp_dim} is not a float multiple of hidden_dim={hidden_dim}")
    norm = partial(nn.LayerNorm, eps=1e-6)
    stages: OrderedDict[str, nn.Module] = OrderedDict(embed=_VitEmbed(image_size, patch_size, hidden_dim, dropout_rate))
    for i in range(num_layers):
        stages[f"block{i}"] = Block(hidden_dim, num_heads, mlp_ratio=mlp_dim / hidden_dim, qkv_bias=qkv_bias,
                                    proj_drop=dropout_rate, attn_drop=attention_dropout_rate,
                                    drop_path=drop_path_rate * i / max(num_layers - 1, 1), norm_layer=norm)
    stages.update(norm=norm(hidden_dim), pool=_TokenPool(classifier))
    trunk = nn.Sequential(stages)
    for m in trunk.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return trunk


TRUNKS = {"resnet": resnet_trunk, "regnet": regnet_trunk, "vision_transformer": vit_trunk}


def mlp_head(dims: list[int], use_bn: bool = False, use_relu: bool = False, use_dropout: bool = False,
             use_bias: bool = True, skip_last_layer_relu_bn: bool = True, *, bn_eps: float = 1e-5,
             bn_momentum: float = 0.1) -> nn.Sequential:
    """VISSL's ``mlp`` head: per pair of ``dims`` a Linear, then BN/ReLU/Dropout (not after the last
    Linear when ``skip_last_layer_relu_bn``)."""
    if not isinstance(dims, (list, tuple)) or len(dims) < 2:
        raise ConfigError(f"mlp head: dims={dims!r}: give at least [in, out]")
    layers: list[nn.Module] = [nn.Flatten(1)]
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(d_in, d_out, bias=use_bias))
        if i == len(dims) - 2 and skip_last_layer_relu_bn:
            break
        if use_bn:
            layers.append(nn.BatchNorm1d(d_out, eps=bn_eps, momentum=bn_momentum))
        if use_relu:
            layers.append(nn.ReLU(inplace=True))
        if use_dropout:
            layers.append(nn.Dropout())
    return nn.Sequential(*layers)


def eval_mlp_head(in_channels: int, dims: list[int], use_bn: bool = False, use_relu: bool = False, *,
                  bn_eps: float = 1e-5, bn_momentum: float = 0.1) -> nn.Sequential:
    """VISSL's ``eval_mlp`` head: BatchNorm2d over the features (as N x C x 1 x 1), then an mlp."""
    return nn.Sequential(nn.Unflatten(1, (in_channels, 1, 1)),
                         nn.BatchNorm2d(in_channels, eps=bn_eps, momentum=bn_momentum),
                         mlp_head(dims, use_bn, use_relu, bn_eps=bn_eps, bn_momentum=bn_momentum))


HEADS = {"mlp": mlp_head, "eval_mlp": eval_mlp_head}
LOSSES = {"cross_entropy_multiple_output_single_target": ("weight", "reduction", "ignore_index", "normalize_output",
                                                          "temperature"),
          "CrossEntropyLoss": ("weight", "reduction", "ignore_index", "label_smoothing")}


@MODELS.register()
class VisslModel(BaseModel):
    """A VISSL model: ``trunk`` (dict with ``name``, see :data:`TRUNKS`), ``heads`` (VISSL's
    ``[[name, {kwargs}], ...]``, applied in order) and ``loss`` (dict with ``name``, see :data:`LOSSES`)."""

    def __init__(self, trunk: dict, heads: list | None = None, loss: dict | None = None, head_bn_eps: float = 1e-5,
                 head_bn_momentum: float = 0.1, head_params_multiplier: float = 1.0,
                 data_preprocessor: nn.Module | dict | None = None, init_cfg: Any = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.trunk = build_trunk(trunk)
        modules = []
        for i, item in enumerate(heads or []):
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and item[0] in HEADS):
                raise ConfigError(f"model.heads[{i}]={item!r}: use [name, {{kwargs}}] with name in {list(HEADS)}")
            kwargs = dict(item[1] or {})
            check_kwargs(HEADS[item[0]], kwargs, f"model.heads[{i}] ({item[0]})")
            modules.append(HEADS[item[0]](**kwargs, bn_eps=head_bn_eps, bn_momentum=head_bn_momentum))
        self.heads = nn.Sequential(*modules)
        with torch.no_grad():
            for m in self.heads.modules():
                if isinstance(m, nn.Linear) and head_params_multiplier != 1.0:
                    m.weight.mul_(head_params_multiplier)
                    if m.bias is not None:
                        m.bias.mul_(head_params_multiplier)
        loss = dict(loss or {"name": "cross_entropy_multiple_output_single_target"})
        name = loss.pop("name", None)
        if name not in LOSSES:
            raise ConfigError(f"model.loss.name={name!r}: {did_you_mean(str(name), LOSSES)}")
        for k in loss:
            if k not in LOSSES[name]:
                raise ConfigError(f"model.loss.{k}: not an option of {name}: {did_you_mean(str(k), LOSSES[name])}")
        weight = loss.pop("weight", None)
        self.register_buffer("loss_weight", None if weight is None else torch.tensor(weight, dtype=torch.float32),
                             persistent=False)
        self.normalize_output = bool(loss.pop("normalize_output", False))
        self.temperature = float(loss.pop("temperature", 1.0))
        self.loss_options = {"ignore_index": -1, "reduction": "mean", **loss}

    def forward(self, img: torch.Tensor, label: torch.Tensor | None = None, mode: str = "tensor", **_: Any) -> Any:
        out = self.heads(self.trunk(img))
        if mode == "tensor":
            return out
        if mode == "loss":
            logits = out.float()
            if self.normalize_output:
                logits = F.normalize(logits, dim=1, p=2)
            logits = logits / self.temperature
            return {"loss": F.cross_entropy(logits, label, weight=self.loss_weight, **self.loss_options)}
        if mode == "predict":
            return out.float().softmax(-1), label
        raise ValueError(f"unknown mode {mode!r}: use 'loss', 'predict' or 'tensor'")


def build_trunk(spec: dict) -> nn.Sequential:
    """The trunk ``nn.Sequential`` for ``dict(name='resnet'|'regnet'|'vision_transformer', **options)``."""
    if not isinstance(spec, dict) or spec.get("name") not in TRUNKS:
        name = spec.get("name") if isinstance(spec, dict) else spec
        raise ConfigError(f"model.trunk.name={name!r}: {did_you_mean(str(name), TRUNKS)}")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    fn = TRUNKS[spec["name"]]
    if fn is regnet_trunk:  # a RegNet's own 'name' (regnet_y_400mf) travels as regnet_name
        kwargs["name"] = kwargs.pop("regnet_name", None)
    check_kwargs(fn, kwargs, "model.trunk")
    return fn(**kwargs)


__all__ = ["HEADS", "LOSSES", "TRUNKS", "VisslModel", "build_trunk", "eval_mlp_head", "mlp_head", "regnet_trunk",
           "resnet_trunk", "vit_trunk"]
