"""Check a DeepSpeedStrategy's DeepSpeed keys before training, each refusal one line naming the key.

DeepSpeed validates its config with pydantic models inside ``deepspeed.initialize``, so a wrong value
(``zero_optimization=dict(stage=7)``) fails there with a multi-line ``ValidationError`` naming a model
(``DeepSpeedZeroConfig``), not the config key. :func:`check_deepspeed_config` runs DeepSpeed's own
parser (``DeepSpeedConfig``) on the strategy's keys when the strategy joins its process group, with
placeholders for the batch keys memfit fills in later, and :func:`deepspeed_config_error` turns what
it raises into ``strategy.zero_optimization.stage=7: use 0, 1, 2 or 3 (DeepSpeed's DeepSpeedZeroConfig)``.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean, first_line

# DeepSpeed sections that must be dicts (a bare value fails deep inside DeepSpeed's parser).
_DICT_SECTIONS = ("zero_optimization", "fp16", "bf16", "torch_autocast", "activation_checkpointing", "aio",
                  "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler", "compile")
# memfit fills these from train_dataloader.batch_size and optim_wrapper.accumulative_counts (build_config).
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _models() -> dict[str, tuple[str, Any]]:
    """DeepSpeed's pydantic model name -> (its section of the config, the model class)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}
    return {cls.__name__: (section, cls) for section, cls in sections.items()}


def check_deepspeed_config(ds_config: Mapping[str, Any]) -> None:
    """Parse the strategy's DeepSpeed keys as ``deepspeed.initialize`` will (DeepSpeed's ``DeepSpeedConfig``),
    before any model or data is built; raise :func:`deepspeed_config_error`'s one line on a refusal."""
    for section in _DICT_SECTIONS:
        value = ds_config.get(section)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigTypeError(f"strategy.{section}={value!r}: got {type(value).__name__}: use a dict "
                                  f"(e.g. zero_optimization=dict(stage=2))")
    from deepspeed.runtime.config import DeepSpeedConfig

    config = {k: v for k, v in ds_config.items() if k not in _BATCH_KEYS and k != "amp"}  # amp: memfit's autocast
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    try:
        DeepSpeedConfig(config)
    except Exception as exc:
        raise deepspeed_config_error(exc) from exc


def deepspeed_config_error(exc: BaseException) -> ConfigError:
    """One line for what DeepSpeed's config parser raised: a pydantic ``ValidationError`` names the key
    (``strategy.<section>.<field>``), anything else is quoted with the strategy as the key."""
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if not (callable(errors) and title):  # DeepSpeedConfigError, an assertion, a bad enum value
        return ConfigError(f"strategy: DeepSpeed refuses the config: {first_line(exc)}: fix the strategy's "
                           "DeepSpeed keys (see DeepSpeed's config documentation)")
    found = errors()
    error, more = found[0], len(found) - 1
    section, model = _models().get(title, (None, None))
    where = f"strategy.{section}" if section else f"strategy (DeepSpeed's {title})"
    path = [str(p) for p in error.get("loc", ())]
    tail = f" ({more} more)" if more else ""
    if error.get("type") == "extra_forbidden":
        valid = _fields(_model_at(model, path[:-1]))
        parent = ".".join([where, *path[:-1]])
        hint = did_you_mean(path[-1], valid) if valid else "remove it"
        return ConfigError(f"{parent}: unknown key {path[-1]!r}: {hint} (DeepSpeed's {title}){tail}")
    key = ".".join([where, *path])
    msg = re.sub(r"^Value error, ", "", error.get("msg", ""))
    if error.get("type") == "enum":
        expected = (error.get("ctx") or {}).get("expected", "")
        choices = list(dict.fromkeys(c.strip() for c in re.split(r",| or ", expected) if c.strip()))
        msg = f"use {', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else msg
    msg = msg[:1].lower() + msg[1:]
    wrong_type = error.get("type", "").endswith(("_type", "_parsing"))
    text = f"{key}={error.get('input')!r}: {msg} (DeepSpeed's {title}){tail}"
    return ConfigTypeError(text) if wrong_type else ConfigError(text)


def _model_at(model: Any, path: list[str]) -> Any:
    """The pydantic model nested in ``model`` at ``path`` (field names), or None."""
    for name in path:
        field = getattr(model, "model_fields", {}).get(name)
        if field is None:
            return None
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        model = next((k for k in kinds if hasattr(k, "model_fields")), None)
    return model


def _fields(model: Any) -> list[str]:
    """A model's keys as a config writes them: field names and their aliases."""
    fields = getattr(model, "model_fields", {})
    return sorted({*fields, *(f.alias for f in fields.values() if f.alias)})
