"""VISSL's YAML config dialect: a file whose root key is ``config:`` is translated to memfit's config.

``Config.fromfile('vissl.yaml')`` (and so ``memfit train vissl.yaml``) reads such a file through
:func:`translate_vissl`; ``memfit convert vissl.yaml`` prints the result as a Python config. Every
VISSL key has a status in :data:`KEYS` (supported / warned / refused / inert); docs/vissl.md lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.config.vissl.keys import INERT, KEYS, REFUSED, SUPPORTED, WARNED, Key, check_keys
from memfit.config.vissl.schedules import auto_scale_schedule, check_schedule, schedule_value
from memfit.config.vissl.translate import translate
from memfit.errors import ConfigError

ROOT_KEY = "config"

__all__ = ["INERT", "KEYS", "REFUSED", "ROOT_KEY", "SUPPORTED", "WARNED", "Key", "auto_scale_schedule",
           "check_keys", "check_schedule", "is_vissl_config", "schedule_value", "translate", "translate_vissl"]


def is_vissl_config(data: Any) -> bool:
    """True for the contents of a VISSL config file: a mapping with the root key ``config``."""
    return isinstance(data, Mapping) and ROOT_KEY in data


def translate_vissl(data: Mapping[str, Any]) -> dict[str, Any]:
    """The memfit config for the contents of a VISSL file (``{'config': {...}}``)."""
    others = [k for k in data if k != ROOT_KEY]
    if others:
        raise ConfigError(f"a VISSL config has the one root key 'config:', this file also has {others[0]!r}: "
                          "merge Hydra defaults lists and overrides into the config: mapping")
    body = data[ROOT_KEY]
    if not isinstance(body, Mapping):
        raise ConfigError(f"VISSL key 'config' must be a mapping of VISSL keys, got {type(body).__name__}")
    return translate(body)
