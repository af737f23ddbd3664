"""Build an optimizer wrapper from ``optim_wrapper=dict(type=..., optimizer=dict(...), ...)``."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError, ConfigTypeError, MemfitError
from memfit.optim.spec import is_multi_optim_cfg
from memfit.registry import OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS, OPTIMIZERS, copy_cfg

logger = logging.getLogger("memfit")


def build_optim_wrapper(model: nn.Module, cfg: Any, in_backward: bool = False, offload: bool = False) -> Any:
    """Turn the ``optim_wrapper`` config (or a live wrapper) into a wrapper over ``model``'s parameters.

    ``paramwise_cfg`` (weight-decay/lr multipliers by name or kind) shapes the parameter groups;
    frozen parameters are left out. ``in_backward`` steps each parameter inside backward
    (``cfg=dict(optimizer_in_backward=True)``), so all gradients are never alive at once; ``offload``
    keeps the optimizer state and step on the host (``cfg=dict(optimizer_offload=True)``).
    ``constructor='MyConstructor'`` builds through a registered constructor class, as MMEngine's
    (``MyConstructor(optim_wrapper_cfg, paramwise_cfg)(model)``). Several optimizers: a dict of
    OptimWrappers, or of configs without ``constructor`` (each over the submodule of its name).
    """
    from memfit.optim.wrapper import OptimWrapper
    from memfit.optim.wrapper_dict import OptimWrapperDict

    if isinstance(cfg, OptimWrapper):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigTypeError(f"optim_wrapper must be a dict or an OptimWrapper, got {type(cfg).__name__}")
    cfg = dict(cfg)
    constructor = cfg.pop("constructor", None)
    paramwise_cfg = cfg.pop("paramwise_cfg", None)
    if constructor is None and is_multi_optim_cfg(cfg):
        if all(isinstance(v, OptimWrapper) for v in cfg.values()):
            return OptimWrapperDict(**cfg)
        constructor = "MultiOptimWrapperConstructor"
    if constructor is not None:
        if in_backward or offload:
            switch = "optimizer_in_backward" if in_backward else "optimizer_offload"
            raise ConfigError(f"cfg.{switch} builds the optimizer itself: remove optim_wrapper.constructor or {switch}")
        built = OPTIM_WRAPPER_CONSTRUCTORS.build(
            {"type": constructor, "optim_wrapper_cfg": cfg, "paramwise_cfg": paramwise_cfg},
            key="optim_wrapper.constructor")
        return built(model)
    return _build_one_wrapper(model, cfg, paramwise_cfg, in_backward, offload)


def _build_one_wrapper(model: nn.Module, cfg: dict, paramwise_cfg: dict | None, in_backward: bool,
                       offload: bool = False, key: str = "optim_wrapper") -> Any:
    cfg = dict(cfg)
    cfg.setdefault("type", "OptimWrapper")
    optimizer_cfg = cfg.pop("optimizer", None)
    if optimizer_cfg is None:
        raise ConfigError(f"{key}.optimizer is missing: e.g. optimizer=dict(type='SGD', lr=0.01)")
    optimizer = build_optimizer(model, optimizer_cfg, paramwise_cfg, in_backward=in_backward, offload=offload,
                                key=f"{key}.optimizer")
    wrapper = OPTIM_WRAPPERS.build(cfg, key=key, optimizer=optimizer)
    if paramwise_cfg and isinstance(optimizer_cfg, dict):  # get_lr() reports MMEngine's per-parameter groups
        from memfit.optim.param_groups import original_groups

        wrapper.original_groups = original_groups(model, optimizer.param_groups)
    return wrapper


@OPTIM_WRAPPER_CONSTRUCTORS.register()
class DefaultOptimWrapperConstructor:
    """MMEngine's default constructor: one optimizer over the model (``paramwise_cfg`` groups).
    Subclass it and register the subclass to build optimizers your own way."""

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: dict | None = None) -> None:
        if not isinstance(optim_wrapper_cfg, dict):
            raise ConfigTypeError(f"optim_wrapper_cfg should be a dict, got {type(optim_wrapper_cfg).__name__}")
        if "optimizer" not in optim_wrapper_cfg:
            raise ConfigError("optim_wrapper.optimizer is missing: e.g. optimizer=dict(type='SGD', lr=0.01)")
        if paramwise_cfg is not None and not isinstance(paramwise_cfg, dict):
            raise ConfigTypeError(f"paramwise_cfg should be None or a dict, got {type(paramwise_cfg).__name__}")
        self.optim_wrapper_cfg = dict(optim_wrapper_cfg)
        self.optimizer_cfg = self.optim_wrapper_cfg["optimizer"]
        self.paramwise_cfg = paramwise_cfg or {}
        self.base_lr = self.optimizer_cfg.get("lr") if isinstance(self.optimizer_cfg, dict) else None
        self.base_wd = self.optimizer_cfg.get("weight_decay") if isinstance(self.optimizer_cfg, dict) else None

    def __call__(self, model: nn.Module) -> Any:
        return _build_one_wrapper(model, self.optim_wrapper_cfg, self.paramwise_cfg or None, False)

    def add_params(self, params: list, module: nn.Module, prefix: str = "") -> None:
        """Append ``module``'s param groups under ``paramwise_cfg`` to ``params`` (MMEngine's hook for
        custom constructors; memfit's groups hold every parameter with equal options)."""
        from memfit.optim.param_groups import build_param_groups

        params.extend(build_param_groups(module, lr=self.base_lr or 0.0, weight_decay=self.base_wd,
                                         paramwise_cfg=self.paramwise_cfg))


@OPTIM_WRAPPER_CONSTRUCTORS.register()
class MultiOptimWrapperConstructor:
    """One OptimWrapper per named submodule: ``dict(generator=dict(optimizer=...), discriminator=...)``
    builds ``OptimWrapperDict`` with an optimizer over ``model.generator`` and one over
    ``model.discriminator`` (each entry may hold its own ``paramwise_cfg`` and ``constructor``)."""

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: dict | None = None) -> None:
        if paramwise_cfg:
            raise ConfigError("optim_wrapper.paramwise_cfg with several optimizers: put a paramwise_cfg "
                              "inside each optimizer's entry")
        self.optim_wrapper_cfg = dict(optim_wrapper_cfg)

    def __call__(self, model: nn.Module) -> Any:
        from memfit.optim.wrapper import OptimWrapper
        from memfit.optim.wrapper_dict import OptimWrapperDict

        wrappers = {}
        for name, sub in self.optim_wrapper_cfg.items():
            if isinstance(sub, OptimWrapper):
                wrappers[name] = sub
                continue
            try:
                module = model.get_submodule(name)
            except AttributeError:
                children = [n for n, _ in model.named_children()]
                raise ConfigError(f"optim_wrapper.{name}: the model has no submodule {name!r} to optimize "
                                  f"(its children: {children})") from None
            sub = dict(sub)
            if sub.get("constructor") is not None:
                wrappers[name] = build_optim_wrapper(module, sub)
            else:
                paramwise = sub.pop("paramwise_cfg", None)
                wrappers[name] = _build_one_wrapper(module, sub, paramwise, False, key=f"optim_wrapper.{name}")
        return OptimWrapperDict(**wrappers)


def scale_lr_cfg(cfg: Any, auto_scale_lr: dict | None, real_batch_size: Callable[[], int]) -> Any:
    """``auto_scale_lr=dict(enable=True, base_batch_size=B)``: every optimizer's ``lr`` in the config
    times (real batch size / B), as MMEngine's linear scaling rule; the config unchanged otherwise."""
    if not (isinstance(cfg, dict) and auto_scale_lr and auto_scale_lr.get("enable", False)):
        return cfg
    base = auto_scale_lr.get("base_batch_size")
    if not base:
        raise ConfigError("auto_scale_lr.base_batch_size is required when auto_scale_lr.enable=True")
    real = real_batch_size()
    cfg = copy_cfg(cfg)
    subs = {k: v for k, v in cfg.items() if isinstance(v, dict)} if is_multi_optim_cfg(cfg) else {"": cfg}
    for name, sub in subs.items():
        optimizer = sub.get("optimizer")
        if not (isinstance(optimizer, dict) and "lr" in optimizer):
            raise ConfigError(f"auto_scale_lr: optim_wrapper{'.' + name if name else ''}.optimizer sets no lr to scale")
        sub["optimizer"] = {**optimizer, "lr": optimizer["lr"] * real / base}
        logger.info(f"auto_scale_lr: {'(' + name + ') ' if name else ''}lr scaled by {real}/{base} "
                    f"to {sub['optimizer']['lr']:.4e}")
    return cfg


def build_optimizer(model: nn.Module, cfg: Any, paramwise_cfg: dict | None = None, in_backward: bool = False,
                    offload: bool = False, key: str = "optim_wrapper.optimizer") -> Any:
    """Build the torch optimizer; a live optimizer object is returned unchanged (``offload`` needs a config).
    ``key`` names the config entry in errors (``optim_wrapper.generator.optimizer`` with several)."""
    if not isinstance(cfg, dict):
        if offload:
            raise ConfigError("cfg.optimizer_offload builds the optimizer on the host from its config: give "
                              "optim_wrapper.optimizer as a dict, not a built optimizer")
        return cfg
    cfg = dict(cfg)
    for k, v in cfg.items():
        if k != "type" and isinstance(v, str) and _is_number(v):
            # A TypeError, as torch's own comparison of the str with a number would raise.
            raise ConfigTypeError(f"{key}.{k}={v!r} is a string: write the number {float(v)!r} "
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
    if cfg.get("fused") is not None and cfg.get("type") is not None:  # no type: the build below says so
        from memfit.speed.fused import check_fused

        kind = cfg.get("type")
        check_fused(cfg, OPTIMIZERS.get(kind, key=f"{key}.type") if isinstance(kind, str) else kind,
                    params, host=offload)
    if in_backward:
        from memfit.optim.in_backward import OptimizerInBackward

        # Each per-parameter optimizer is built through the registry: its errors name the config key.
        return OptimizerInBackward(params, partial(_build_one, cfg, key=key))
    if offload:
        from memfit.optim.offload import OffloadedOptimizer

        optimizer = OffloadedOptimizer(params, partial(_build_one, cfg, key=key))
        logger.info(f"optimizer offload: {type(optimizer.host_optimizer).__name__}'s state and step on the host")
        return optimizer
    return _build_one(cfg, params, key=key)


def _build_one(cfg: dict, groups: list, key: str = "optim_wrapper.optimizer") -> Any:
    """The optimizer over ``groups``; a constructor error names the config key that caused it."""
    try:
        return OPTIMIZERS.build(cfg, key=key, params=groups)
    except ConfigError as exc:
        if exc.__cause__ is None or isinstance(exc.__cause__, MemfitError):
            raise
        raise _with_key(exc, cfg, key) from exc.__cause__


def _with_key(exc: ConfigError, cfg: dict, key: str) -> ConfigError:
    """``exc`` (``optim_wrapper.optimizer: <torch's words> (SGD)``) with the key that caused it, found by
    building the optimizer over a probe parameter without each key in turn: the one whose removal lets
    it build (torch's messages name the value, as 'invalid momentum value', never the key)."""
    kind = cfg.get("type")
    target = OPTIMIZERS.get(kind) if isinstance(kind, str) else kind
    args = {k: v for k, v in cfg.items() if k != "type"}

    def builds(kwargs: dict) -> bool:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target([nn.Parameter(torch.zeros(1))], **kwargs)
        except Exception:
            return False
        return True

    if builds(args):  # the config builds alone: the cause is in the parameter groups (paramwise_cfg)
        return exc
    name = next((k for k in args if builds({n: v for n, v in args.items() if n != k})), None)
    if name is None:
        return exc
    message = str(exc).replace(f"{key}: ", f"{key}.{name}={args[name]!r}: ", 1)
    default = _default(target, name)
    if isinstance(exc, TypeError) and isinstance(default, int | float) and not isinstance(default, bool):
        message += f": use a number (the default is {default!r})"
    elif isinstance(default, tuple) and not (isinstance(args[name], list | tuple) and len(args[name]) == len(default)):
        message += f": give {len(default)} values, as the default {default!r}"  # e.g. betas=[0.9]: an IndexError
    return type(exc)(message)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _default(target: Any, name: str) -> Any:
    """The default of ``target``'s argument ``name`` (None when it has none or cannot be read)."""
    try:
        default = inspect.signature(target).parameters[name].default
    except (KeyError, TypeError, ValueError):
        return None
    return None if default is inspect.Parameter.empty else default


def _default_wd(kind: Any) -> float | None:
    default = _default(OPTIMIZERS.get(kind) if isinstance(kind, str) else kind, "weight_decay")
    return default if isinstance(default, (int, float)) else None
