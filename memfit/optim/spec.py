"""An ``optim_wrapper`` read once: what the connector and the planner need before the wrapper is built.

The Runner keeps MMEngine's ``optim_wrapper=dict(...)`` argument as it is; whoever needs its accumulation,
clipping or optimizer before :func:`memfit.optim.builder.build_optim_wrapper` runs reads an
:class:`OptimWrapperSpec`, checked by the same functions as the built :class:`~memfit.optim.wrapper.OptimWrapper`
(a bad value is the same one-line error, wherever it is read first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, type_or_value_error

_CLIP_KEYS = {"max_norm", "norm_type", "error_if_nonfinite", "foreach", "type"}


def check_accumulative_counts(value: Any, key: str = "optim_wrapper.accumulative_counts") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise type_or_value_error(f"{key}={value!r}: use an int >= 1", not isinstance(value, int))
    return value


def check_clip_grad(value: Any, key: str = "optim_wrapper.clip_grad") -> dict | None:
    """``clip_grad`` without its ``type`` (only 'norm' clipping exists), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigTypeError(f"{key}={value!r}: use dict(max_norm=..., norm_type=2)")
    if set(value) - _CLIP_KEYS or "max_norm" not in value:
        raise ConfigError(f"{key}={value!r}: use dict(max_norm=..., norm_type=2)")
    if value.get("type", "norm") != "norm":
        raise ConfigError(f"{key}.type: only 'norm' clipping is supported")
    # torch scales the gradients by max_norm / norm: a max_norm of 0 zeroes them, a negative one flips them
    _positive_number(value["max_norm"], f"{key}.max_norm", "the largest gradient norm, e.g. max_norm=1.0")
    if "norm_type" in value:
        _positive_number(value["norm_type"], f"{key}.norm_type", "2 (L2), 1, or 'inf'")
    return {k: v for k, v in value.items() if k != "type"} or None


def _positive_number(value: Any, key: str, what: str) -> None:
    """Refuse ``value`` unless it is an int or float above 0 (``float('inf')``, or ``'inf'`` as torch takes it)."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else (
        float("inf") if value in ("inf", "Inf") else None)
    if number is None or not number > 0:
        raise type_or_value_error(f"{key}={value!r}: use a number above 0: {what}", number is None)


def is_multi_optim_cfg(cfg: Any) -> bool:
    """True for ``dict(generator=dict(optimizer=...), discriminator=...)``: several optimizers (config dicts or
    built wrappers, which step with ``update_params``)."""
    return (isinstance(cfg, dict) and bool(cfg) and "optimizer" not in cfg and "type" not in cfg
            and all(isinstance(v, dict) or hasattr(v, "update_params") for k, v in cfg.items() if k != "constructor"))


def _type_name(kind: Any) -> str:
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


@dataclass(frozen=True)
class OptimWrapperSpec:
    """``type`` (the wrapper's name), ``accumulative_counts``, ``clip_grad`` (checked), ``optimizer`` (its config
    dict, or None for a live optimizer or several optimizers) and ``several`` (one wrapper per optimizer)."""

    type: str = "OptimWrapper"
    accumulative_counts: int = 1
    clip_grad: dict | None = None
    optimizer: dict | None = None
    several: bool = False

    @classmethod
    def of(cls, cfg: Any) -> OptimWrapperSpec:
        """Read a config dict, a built wrapper or None (no optimizer: the defaults)."""
        if cfg is None:
            return cls()
        if not isinstance(cfg, dict):  # a built wrapper (or an OptimWrapperDict)
            several = hasattr(cfg, "optim_wrappers")
            return cls(type=type(cfg).__name__, several=several,
                       accumulative_counts=1 if several else int(getattr(cfg, "accumulative_counts", 1)),
                       clip_grad=None if several else getattr(cfg, "clip_grad", None))
        if is_multi_optim_cfg(cfg):
            return cls(type="OptimWrapperDict", several=True)
        optimizer = cfg.get("optimizer")
        return cls(type=_type_name(cfg.get("type", "OptimWrapper")),
                   accumulative_counts=check_accumulative_counts(cfg.get("accumulative_counts", 1)),
                   clip_grad=check_clip_grad(cfg.get("clip_grad")),
                   optimizer=dict(optimizer) if isinstance(optimizer, dict) else None)

    @property
    def fused(self) -> bool:
        """The optimizer config asks for torch's fused implementation."""
        return bool(self.optimizer and self.optimizer.get("fused"))
