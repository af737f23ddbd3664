"""Checks for DINO's nested config dicts (encoder.layer_cfg.self_attn_cfg, bbox_head.loss_cls, ...)."""

from __future__ import annotations

import re
from typing import Any

from memfit.errors import ConfigError
from memfit.registry import check_kwargs


def build_part(cls: type, cfg: dict | None, key: str, **fixed: Any) -> Any:
    """``cls(**cfg, **fixed)`` with the errors a user can act on: an unknown key of ``cfg`` is a one-line
    ConfigError naming ``key.<name>`` and the nearest valid name, and a ConfigError from the constructor
    (a value memfit does not implement) gets ``key: `` in front."""
    if cfg is not None and not isinstance(cfg, dict):
        raise ConfigError(f"{key} must be a dict, got {type(cfg).__name__}")
    cfg = dict(cfg or {})
    clash = sorted(set(cfg) & set(fixed))
    if clash:
        raise ConfigError(f"{key}.{clash[0]} is set by the detector: remove it from {key}")
    check_kwargs(cls, cfg, key)
    try:
        return cls(**cfg, **fixed)
    except ConfigError as exc:
        raise ConfigError(prefix(key, str(exc))) from None


def prefix(key: str, message: str) -> str:
    """``key`` in front of ``message``: dotted when the message starts with a nested key (``model.encoder`` +
    ``layer_cfg.ffn_cfg: unknown key ...`` or ``num_layers=0 ...``), else ``key: message``; a message that
    already names a model-level key (``model.train_cfg...``) is kept as it is."""
    if message.startswith("model."):
        return message
    return f"{key}.{message}" if re.match(r"[A-Za-z_]\w*[.\[=:]", message) else f"{key}: {message}"


def pop_type(cfg: dict | None, key: str, supported: tuple[str, ...], default: str | None = None) -> tuple[str, dict]:
    """Split ``cfg`` into its ``type`` (one of ``supported``) and the rest; ConfigError otherwise."""
    cfg = dict(cfg or {})
    kind = cfg.pop("type", default)
    if kind not in supported:
        raise ConfigError(f"{key}.type={kind!r} is not supported: use {' or '.join(map(repr, supported))}")
    return kind, cfg
