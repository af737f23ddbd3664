"""Reading CheckpointHook's options: metric lists and comparison rules, checked with one-line errors."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError, ConfigTypeError

_WHERE = "default_hooks.checkpoint"


def str_list(name: str, value: Any, default: list[str] | None) -> list[str] | None:
    """None -> ``default``; a str -> [it]; a list/tuple of str as a list (no duplicates)."""
    if value is None:
        return default
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(k, str) for k in items):
        raise ConfigTypeError(f"{_WHERE}.{name}={value!r}: use a str or a list of str")
    if len(set(items)) != len(items):
        raise ConfigError(f"{_WHERE}.{name}={value!r}: remove the duplicate entries")
    return list(items)


def save_best_list(save_best: Any) -> list[str] | None:
    keys = str_list("save_best", save_best, None)
    if keys is not None and "auto" in keys and len(keys) > 1:
        raise ConfigError(f"{_WHERE}.save_best={save_best!r}: 'auto' (the first metric) cannot be combined with "
                          "other metrics; give 'auto' alone or name the metrics")
    return keys


def rule_list(rule: Any, save_best: list[str] | None) -> list[str | None]:
    rules = list(rule) if isinstance(rule, list | tuple) else [rule]
    for r in rules:
        if r not in (None, "greater", "less"):
            raise ConfigError(f"{_WHERE}.rule={r!r}: use 'greater' or 'less' (or None to decide by the key)")
    if len(rules) not in (1, len(save_best or rules)):
        raise ConfigError(f"{_WHERE}.rule={rule!r}: give one rule, or one per save_best metric "
                          f"({len(save_best or [])})")
    return rules
