"""What memfit hands ``timm.create_model``, checked before the model is built: the model's name, and the
drop rates (probabilities) that timm takes without a look, so that 1.5 would fail only at the first step."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean


def check_timm_args(model_name: str, kwargs: dict[str, Any], where: str) -> None:
    """Refuse an unknown timm ``model_name`` and a ``*drop*_rate`` outside [0, 1]; ``where`` prefixes the
    keys in messages (``model``, ``backbone``)."""
    import timm

    if not isinstance(model_name, str) or not timm.is_model(model_name):
        raise ConfigError(f"{where}.model_name: unknown timm model {model_name!r}: "
                          f"{did_you_mean(str(model_name), timm.list_models())}")
    for key, value in kwargs.items():
        if "drop" not in key or not key.endswith("_rate"):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigTypeError(f"{where}.{key}={value!r}: use a probability, a number in [0, 1]")
        if not 0 <= value <= 1:
            raise ConfigError(f"{where}.{key}={value!r}: use a probability, a number in [0, 1] (e.g. 0.1)")
