"""Build an optimizer wrapper from ``optim_wrapper=dict(type=..., optimizer=dict(...), ...)``."""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit.errors import ConfigError
from memfit.registry import OPTIM_WRAPPERS, OPTIMIZERS


def build_optim_wrapper(model: nn.Module, cfg: Any, in_backward: bool = False) -> Any:
    """Turn the ``optim_wrapper`` config (or a live wrapper) into a wrapper over ``model``'s parameters.

    ``paramwise_cfg`` (weight-decay/lr multipliers by name or kind) shapes the parameter groups;
    frozen parameters are left out. ``in_backward`` steps each parameter inside backward
    (``cfg=dict(optimizer_in_backward=True)``), so all gradients are never alive at once.
    """
    from memfit.optim.wrapper import OptimWrapper

    if isinstance(cfg, OptimWrapper):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigError(f"optim_wrapper must be a dict or an OptimWrapper, got {type(cfg).__name__}")
    cfg = dict(cfg)
    cfg.setdefault("type", "OptimWrapper")
    optimizer_cfg = cfg.pop("optimizer", None)
    if optimizer_cfg is None:
        raise ConfigError("optim_wrapper.optimizer is missing: e.g. optimizer=dict(type='SGD', lr=0.01)")
    paramwise_cfg = cfg.pop("paramwise_cfg", None)
    cfg.pop("constructor", None)
    optimizer = build_optimizer(model, optimizer_cfg, paramwise_cfg, in_backward=in_backward)
    return OPTIM_WRAPPERS.build(cfg, key="optim_wrapper", optimizer=optimizer)


def build_optimizer(model: nn.Module, cfg: Any, paramwise_cfg: dict | None = None, in_backward: bool = False) -> Any:
    """Build the torch optimizer; a live optimizer object is returned unchanged."""
    if not isinstance(cfg, dict):
        return cfg
    cfg = dict(cfg)
    for k, v in cfg.items():
        if k != "type" and isinstance(v, str) and _is_number(v):
            raise ConfigError(f"optim_wrapper.optimizer.{k}={v!r} is a string: write the number {float(v)!r} "
                              "(YAML reads 1e-3 as text; 1.0e-3 is a number)")
    if paramwise_cfg:
        from memfit.optim.param_groups import build_param_groups

        # Multipliers apply to the optimizer's own default weight decay when the config sets none.
        params: Any = build_param_groups(
            model, lr=cfg.get("lr", 0.0), weight_decay=cfg.get("weight_decay", _default_wd(cfg.get("type"))),
            paramwise_cfg=paramwise_cfg,
        )
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (all requires_grad=False)")
    if in_backward:
        from functools import partial

        from memfit.optim.in_backward import OptimizerInBackward

        # Each per-parameter optimizer is built through the registry: its errors name the config key.
        return OptimizerInBackward(params, partial(_build_one, cfg))
    return OPTIMIZERS.build(cfg, key="optim_wrapper.optimizer", params=params)


def _build_one(cfg: dict, groups: list) -> Any:
    return OPTIMIZERS.build(cfg, key="optim_wrapper.optimizer", params=groups)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _default_wd(kind: Any) -> float | None:
    import inspect

    target = OPTIMIZERS.get(kind) if isinstance(kind, str) else kind
    try:
        default = inspect.signature(target).parameters["weight_decay"].default
    except (KeyError, TypeError, ValueError):
        return None
    return default if isinstance(default, (int, float)) else None
