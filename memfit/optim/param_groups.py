"""Param-wise optimizer options: MMEngine's ``paramwise_cfg`` turned into torch param groups.

Rules, as MMEngine's ``DefaultOptimWrapperConstructor`` applies them to each parameter:

1. ``custom_keys={'backbone': dict(lr_mult=0.1, decay_mult=1.0)}``: a key matches a parameter when it
   is a substring of its qualified name; keys are tried longest first (ties alphabetically), the
   first match wins and the rules below are skipped. Other keys in the dict (``betas``, ...) are
   copied into the group.
2. Otherwise, ``bias_lr_mult`` scales the lr of every ``bias`` except norm layers', and one weight
   decay multiplier applies, the first that fits: ``norm_decay_mult`` (parameters of BatchNorm,
   InstanceNorm, GroupNorm, LayerNorm, RMSNorm and their subclasses), ``bias_decay_mult``,
   ``dwconv_decay_mult`` (depth-wise convs: ``groups == in_channels``), ``flat_decay_mult``
   (any other 1-D parameter).

Frozen parameters (``requires_grad=False``) are left out. Parameters with equal options share one
group (fewer groups: faster foreach optimizers) whose ``param_names`` lists their names: torch's
own key for named parameters, kept through ``state_dict``/``load_state_dict``. A parameter shared
by two modules (tied weights) is an error unless ``bypass_duplicate=True`` (first owner wins).
:func:`original_groups` maps MMEngine's per-parameter groups onto the merged ones, for ``get_lr()``.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean, nearest

logger = logging.getLogger("memfit")

_MULTS = ("bias_lr_mult", "bias_decay_mult", "norm_decay_mult", "dwconv_decay_mult", "flat_decay_mult")
PARAMWISE_KEYS = (*_MULTS, "custom_keys", "bypass_duplicate")
_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, nn.LocalResponseNorm)


def _check_cfg(cfg: dict) -> dict[str, dict]:
    """Validate ``paramwise_cfg``; return its custom keys."""
    for key in cfg:
        if key == "dcn_offset_lr_mult":
            raise ConfigError(
                "paramwise_cfg.dcn_offset_lr_mult: memfit has no MMCV deformable conv; use "
                "custom_keys={'conv_offset': dict(lr_mult=...)} instead"
            )
        if key not in PARAMWISE_KEYS:
            raise ConfigError(f"paramwise_cfg: unknown key {key!r}: {did_you_mean(key, PARAMWISE_KEYS)}")
    for key in _MULTS:
        if key in cfg:
            _check_mult(cfg[key], f"paramwise_cfg.{key}")
    custom = cfg.get("custom_keys") or {}
    if not isinstance(custom, dict) or not all(isinstance(v, dict) for v in custom.values()):
        raise ConfigTypeError("paramwise_cfg.custom_keys: use a dict: name -> dict(lr_mult=.., decay_mult=..)")
    for key, opts in custom.items():
        for opt in ("lr_mult", "decay_mult"):
            if opt in opts:
                _check_mult(opts[opt], f"paramwise_cfg.custom_keys[{key!r}].{opt}")
        for opt in opts:
            # Other keys are optimizer options copied into the group; one that looks like a
            # misspelt multiplier would be silently ignored by torch, so it is an error.
            mults = ("lr_mult", "decay_mult")
            if opt not in mults and (opt.endswith("_mult") or nearest(opt, mults)):
                raise ConfigError(
                    f"paramwise_cfg.custom_keys[{key!r}]: unknown key {opt!r}: "
                    f"{did_you_mean(opt, ['lr_mult', 'decay_mult'])}"
                )
    return custom


def _check_mult(value: Any, where: str) -> None:
    """A multiplier is a number >= 0: a negative one makes a negative lr or weight decay, which torch takes
    from a parameter group without a word (its optimizers check only their default lr)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigTypeError(f"{where}={value!r}: use a number")
    if value < 0:
        raise ConfigError(f"{where}={value!r}: use a number >= 0 (0 freezes the lr or the decay; a negative "
                          f"multiplier would climb the loss or grow the weights)")


def _options(
    name: str, pname: str, param: nn.Parameter, module: nn.Module, *, lr: float, weight_decay: float | None,
    cfg: dict, sorted_keys: list[str], custom: dict[str, dict], used: set[str],
) -> dict[str, Any]:
    """The optimizer options of one parameter (``pname`` is its name inside ``module``)."""
    opts: dict[str, Any] = {"lr": lr}
    if weight_decay is not None:
        opts["weight_decay"] = weight_decay
    for key in sorted_keys:
        if key in name:
            used.add(key)
            extra = custom[key]
            opts["lr"] = lr * extra.get("lr_mult", 1.0)
            if weight_decay is not None:
                opts["weight_decay"] = weight_decay * extra.get("decay_mult", 1.0)
            opts.update({k: v for k, v in extra.items() if k not in ("lr_mult", "decay_mult")})
            return opts
    is_norm = isinstance(module, _NORMS)
    is_dwconv = isinstance(module, nn.modules.conv._ConvNd) and module.groups == module.in_channels
    if pname == "bias" and not is_norm and "bias_lr_mult" in cfg:
        opts["lr"] = lr * cfg["bias_lr_mult"]
    if weight_decay is not None:
        if is_norm and "norm_decay_mult" in cfg:
            opts["weight_decay"] = weight_decay * cfg["norm_decay_mult"]
        elif pname == "bias" and "bias_decay_mult" in cfg:
            opts["weight_decay"] = weight_decay * cfg["bias_decay_mult"]
        elif is_dwconv and "dwconv_decay_mult" in cfg:
            opts["weight_decay"] = weight_decay * cfg["dwconv_decay_mult"]
        elif param.ndim == 1 and "flat_decay_mult" in cfg:
            opts["weight_decay"] = weight_decay * cfg["flat_decay_mult"]
    return opts


def build_param_groups(
    model: nn.Module, *, lr: float, weight_decay: float | None, paramwise_cfg: dict | None
) -> list[dict[str, Any]]:
    """Param groups for ``torch.optim`` from MMEngine's ``paramwise_cfg`` (rules in the module doc).

    ``lr`` and ``weight_decay`` are the optimizer's base values (``weight_decay=None``: the
    optimizer has none, decay multipliers are ignored). Every group carries explicit ``lr`` (and
    ``weight_decay``) and a ``param_names`` list. Unknown keys raise ConfigError with a suggestion;
    a custom key matching no parameter is logged as a warning (MMDetection's Swin configs name
    ``absolute_pos_embed`` for models built without it).
    """
    cfg = dict(paramwise_cfg or {})
    custom = _check_cfg(cfg)
    # Longest first, alphabetical among equal lengths: MMEngine's order, so the most specific key wins.
    sorted_keys = sorted(sorted(custom), key=len, reverse=True)
    used: set[str] = set()
    owner: dict[int, str] = {}
    groups: dict[tuple, dict[str, Any]] = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if id(param) in owner:
                if cfg.get("bypass_duplicate", False):
                    continue
                raise ConfigError(
                    f"parameter {name!r} is the same tensor as {owner[id(param)]!r}: set "
                    "paramwise_cfg.bypass_duplicate=True to optimise it once"
                )
            owner[id(param)] = name
            if not param.requires_grad:
                continue
            opts = _options(name, pname, param, module, lr=lr, weight_decay=weight_decay, cfg=cfg,
                            sorted_keys=sorted_keys, custom=custom, used=used)
            key = tuple(sorted((k, repr(v)) for k, v in opts.items()))
            group = groups.setdefault(key, {"params": [], "param_names": [], **opts})
            group["params"].append(param)
            group["param_names"].append(name)
    for key in sorted(set(custom) - used):
        logger.warning(f"paramwise_cfg.custom_keys[{key!r}] matches no trainable parameter")
    return list(groups.values())


def original_groups(model: nn.Module, groups: list[dict[str, Any]]) -> list[int] | None:
    """For each param group MMEngine's ``DefaultOptimWrapperConstructor`` makes under ``paramwise_cfg``
    (one per trainable parameter, in ``named_modules()`` order, a tied one once), the index of the
    merged group in ``groups`` that holds it; None when a group has no ``param_names`` to map by.

    Parameters of one merged group share their configured options, so MMEngine's per-parameter
    values are the merged group's: ``OptimWrapper.get_lr()`` reports them one per original group.
    """
    where = {name: i for i, group in enumerate(groups) for name in group.get("param_names", ())}
    if len(where) != sum(len(group["params"]) for group in groups):
        return None
    index = []
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            group = where.pop(f"{mname}.{pname}" if mname else pname, None)
            if group is not None:
                index.append(group)
    return index if not where else None
