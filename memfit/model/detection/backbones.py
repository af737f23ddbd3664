"""TimmBackbone: a timm model as a detection backbone, returning NCHW feature maps of chosen stages.

The backbone *is* the timm model (its class gains a feature ``forward``, as FSDP2's ``fully_shard``
swaps a module's class), so parameter names stay timm's (``layers.0.blocks.0...`` for Swin,
``layer1.0...`` for ResNet): timm checkpoints load as they are, and ``backbone.layers`` names
Swin's stages for activation checkpointing. timm's own ``features_only`` wrappers would rename
every parameter (``model.layers...`` or ``layers_0...``) and hide the stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from memfit.errors import ConfigError
from memfit.registry import MODELS

# Models whose stem is a strided conv/pool pair list it as a feature of reduction 2 (ResNet's act1):
# out_indices count the stages from reduction 4, as MMDetection's backbones do.
_MIN_REDUCTION = 4
_cache: dict[type, type] = {}


class _Features:
    """Mixed into a timm model's class: ``forward`` returns the chosen stages' maps; ``norm_eval``
    keeps BatchNorm layers in eval mode through ``train()`` (MMDetection's switch)."""

    out_indices: tuple[int, ...]
    out_channels: list[int]
    strides: list[int]
    norm_eval: bool

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.forward_intermediates(x, indices=list(self._take), intermediates_only=True)

    def train(self, mode: bool = True) -> nn.Module:
        super().train(mode)  # type: ignore[misc]
        if mode and self.norm_eval:
            for m in self.modules():  # type: ignore[attr-defined]
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self  # type: ignore[return-value]


def _feature_class(base: type) -> type:
    if base not in _cache:
        _cache[base] = type(base.__name__, (_Features, base), {"__module__": base.__module__})
    return _cache[base]


@MODELS.register()
def TimmBackbone(  # noqa: N802 - a config type name, as MMDetection's backbones are classes
    model_name: str,
    out_indices: tuple[int, ...] | list[int] = (1, 2, 3),
    pretrained: bool | str = False,
    frozen_stages: int = -1,
    norm_eval: bool = False,
    frozen_bn: bool = False,
    init_cfg: dict | list | None = None,
    **timm_kwargs: Any,
) -> nn.Module:
    """A timm model by name whose ``forward(x)`` returns a list of NCHW maps, one per ``out_indices``.

    ``out_indices`` count stages from the first of stride 4 (MMDetection's: Swin/ConvNeXt/ResNet
    ``(0, 1, 2, 3)`` are all four). ``frozen_stages=k`` stops gradients to the stem and the first
    ``k`` stages (MMDetection's: 0 the stem only, -1 nothing); ``norm_eval`` keeps BatchNorm in eval
    mode while training; ``frozen_bn`` turns BatchNorm into torchvision's FrozenBatchNorm2d (ResNet
    detectors' standard). ``pretrained``: False, True (timm's weights; needs network) or a local
    checkpoint file (loaded with ``weights_only``). ``init_cfg=dict(type='Pretrained', checkpoint=...)``
    (MMDetection's way) loads a local file when the runner initialises the model's weights.
    Swin models get ``dynamic_img_size=True``, so any input divisible by 32 runs. The result has
    ``out_channels`` and ``strides`` lists for the neck.
    """
    import timm

    from memfit.model.timm_args import check_timm_args

    check_timm_args(model_name, timm_kwargs, "backbone")
    if "swin" in model_name:
        timm_kwargs.setdefault("dynamic_img_size", True)
    if isinstance(pretrained, str):
        timm_kwargs["pretrained_cfg_overlay"] = dict(file=pretrained)
        pretrained = True
    model = timm.create_model(model_name, pretrained=pretrained, num_classes=0, **timm_kwargs)
    if not hasattr(model, "forward_intermediates"):
        raise ConfigError(f"backbone.model_name: timm's {model_name!r} has no forward_intermediates, so it cannot "
                          "return stage features; pick a Swin, ConvNeXt, ResNet or ViT model")
    info = list(model.feature_info)
    stages = [i for i, f in enumerate(info) if f["reduction"] >= _MIN_REDUCTION]
    out_indices = tuple(out_indices)
    bad = [i for i in out_indices if not isinstance(i, int) or not 0 <= i < len(stages)]
    if bad or not out_indices:
        raise ConfigError(f"backbone.out_indices={out_indices!r}: {model_name} has {len(stages)} stages, "
                          f"use indices in 0..{len(stages) - 1}")
    if frozen_bn:
        _freeze_batch_norm(model)
    take = tuple(stages[i] for i in out_indices)
    # What the features never reach (later stages, the final norm, the head) would hold parameters without
    # gradients, which DDP rejects and FSDP shards for nothing: timm drops them.
    model.prune_intermediate_layers(list(take), prune_norm=True, prune_head=True)
    model.__class__ = _feature_class(type(model))
    model._take = take
    model.out_indices = out_indices
    model.out_channels = [info[i]["num_chs"] for i in model._take]
    model.strides = [info[i]["reduction"] for i in model._take]
    model.norm_eval = bool(norm_eval)
    model.init_cfg = init_cfg
    _freeze(model, [info[i]["module"] for i in stages], frozen_stages)
    _stage_list(model, [info[i]["module"] for i in stages])
    return model


def _stage_list(model: nn.Module, stage_names: list[str]) -> None:
    """Swin's ``layers`` and ConvNeXt's ``stages`` are Sequentials that ``forward_intermediates`` runs
    stage by stage, never as a whole: as ModuleLists (same parameter names) a checkpointing name like
    ``backbone.layers`` means each stage, instead of a Sequential forward that never runs."""
    parents = {n.rpartition(".")[0] for n in stage_names if "." in n}
    for parent in parents:
        container = model.get_submodule(parent)
        if type(container) is nn.Sequential:
            owner, _, attr = parent.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, nn.ModuleList(container))


def _freeze_batch_norm(module: nn.Module) -> None:
    """Every BatchNorm2d becomes torchvision's FrozenBatchNorm2d with its statistics and affine values.

    torchvision's class rather than timm's: memfit's efficient conv-bn folds torchvision's."""
    from torchvision.ops import FrozenBatchNorm2d

    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            with torch.no_grad():
                if child.affine:
                    frozen.weight.copy_(child.weight)
                    frozen.bias.copy_(child.bias)
                if child.running_mean is not None:
                    frozen.running_mean.copy_(child.running_mean)
                    frozen.running_var.copy_(child.running_var)
            setattr(module, name, frozen.to(child.weight.device if child.affine else None))
        else:
            _freeze_batch_norm(child)


def _freeze(model: nn.Module, stage_names: list[str], frozen_stages: int) -> None:
    """No gradients to the stem (every parameter before the first stage) and the first ``frozen_stages`` stages."""
    if frozen_stages < 0:
        return
    if frozen_stages > len(stage_names):
        raise ConfigError(f"backbone.frozen_stages={frozen_stages}: the model has {len(stage_names)} stages")
    frozen = stage_names[:frozen_stages]
    first = stage_names[0]
    in_stem = True
    for name, p in model.named_parameters():
        if name.startswith(first + "."):
            in_stem = False
        if in_stem or any(name.startswith(s + ".") for s in frozen):
            p.requires_grad_(False)
