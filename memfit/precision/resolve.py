"""The run's one precision, decided in one place.

:func:`resolve_precision` turns (optimizer wrapper, strategy, device) into a :class:`Precision`; the
connector, an optimizer wrapper used on its own and the planner all ask it. :func:`amp_request` reads
what an ``AmpOptimWrapper`` (config or object) asks for; :func:`with_amp` is ``memfit train --amp``.
The strategy is read through its interface only (``precision_request()``), so this module imports none.
"""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.precision.autocast import AutocastPrecision, amp_precision
from memfit.precision.base import Precision, parse_dtype
from memfit.precision.half import HalfPrecision
from memfit.precision.master import precision_from_cfg

AMP_WRAPPER = "AmpOptimWrapper"  # MMEngine's name for "train with autocast"


def _type_name(kind: Any) -> str:
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def _several(wrapper: Any) -> dict | None:
    """The sub-wrappers of several optimizers (an ``OptimWrapperDict`` or its config), else None."""
    subs = getattr(wrapper, "optim_wrappers", None)
    if isinstance(subs, dict):
        return subs
    if (isinstance(wrapper, dict) and wrapper and "optimizer" not in wrapper and "type" not in wrapper
            and all(isinstance(v, dict) or hasattr(v, "update_params")
                    for k, v in wrapper.items() if k != "constructor")):
        return {k: v for k, v in wrapper.items() if k != "constructor"}
    return None


def amp_request(wrapper: Any) -> dict | None:
    """``dtype`` (a torch dtype or None), ``loss_scale`` and ``fp32_modules`` when ``wrapper`` is an
    ``AmpOptimWrapper`` (config dict or built object); None for any other wrapper. Several optimizers share
    the run's one precision: they must ask for the same."""
    subs = _several(wrapper)
    if subs is not None:
        options = {name: amp_request(sub) for name, sub in subs.items()}
        if len({repr(o) for o in options.values()}) > 1:
            raise ConfigError(f"optim_wrapper: the optimizers ask for different precisions ({options}): the model "
                              "runs in one; give every entry the same type (AmpOptimWrapper) and dtype")
        return next(iter(options.values()), None)
    if isinstance(wrapper, dict):
        if _type_name(wrapper.get("type")) != AMP_WRAPPER:
            return None
        return dict(dtype=parse_dtype(wrapper.get("dtype"), "optim_wrapper.dtype"),
                    loss_scale=wrapper.get("loss_scale", "dynamic"), fp32_modules=wrapper.get("fp32_modules"))
    options = getattr(wrapper, "amp_options", None)
    return options() if callable(options) else None


def resolve_precision(wrapper: Any, strategy: Any, device_type: str, precision_cfg: dict | None = None) -> Precision:
    """The run's one precision, from the Runner's ``precision=dict(opt_level=...)`` (Apex's levels), the
    optimizer wrapper (``AmpOptimWrapper``: autocast) or the strategy's own options
    (``strategy.precision_request()``: DeepSpeed's fp16/bf16/torch_autocast, FSDP's mixed_precision,
    colossalai's mixed_precision). Two of these that disagree are refused, in one line."""
    amp = amp_request(wrapper)
    requested = strategy.precision_request() if strategy is not None else None
    where = type(strategy).__name__
    if precision_cfg is not None:
        level = precision_cfg.get("opt_level")
        if amp is not None:
            raise ConfigError(f"precision=dict(opt_level={level!r}) and AmpOptimWrapper both set the precision: keep "
                              "one (opt_level='O1' is AmpOptimWrapper's autocast)")
        if requested is not None:
            raise ConfigError(f"precision=dict(opt_level={level!r}) and {where}'s own precision options "
                              f"({requested.name}) both set the precision: keep one")
        return precision_from_cfg(precision_cfg, device_type)
    if amp is None:
        return requested or Precision(device_type)
    if isinstance(requested, HalfPrecision):
        raise ConfigError(f"AmpOptimWrapper (torch autocast) and {where}'s whole-model {requested.name} "
                          "(parameters cast to half) are two precisions: keep one")
    dtype = amp["dtype"]
    if isinstance(requested, AutocastPrecision):
        if dtype is not None and dtype != requested.dtype:
            raise ConfigError(f"{where} asks for autocast in {requested.name[:4]} and optim_wrapper.dtype for "
                              f"{str(dtype).removeprefix('torch.')}: they disagree, set one of them")
        dtype = requested.dtype
    return amp_precision(dtype, device_type, amp["loss_scale"], amp["fp32_modules"])


def with_amp(optim_wrapper: Any) -> tuple[Any, str | None]:
    """``memfit train --amp`` (MMEngine's ``tools/train.py --amp``): a plain ``OptimWrapper`` config becomes an
    ``AmpOptimWrapper`` with dynamic loss scaling. Returns (config, None), or the config unchanged and why."""
    ow = dict(optim_wrapper or {})
    kind = _type_name(ow.get("type", "OptimWrapper"))
    if kind not in ("OptimWrapper", AMP_WRAPPER):
        return optim_wrapper, f"--amp ignored: optim_wrapper.type is {kind!r}"
    ow["type"] = AMP_WRAPPER
    ow.setdefault("loss_scale", "dynamic")
    return ow, None
