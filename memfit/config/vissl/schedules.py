"""VISSL's parameter schedules: ClassyVision's (fvcore's) schedulers as pure functions of ``where``.

A VISSL schedule (``OPTIMIZER.param_schedulers.lr``) is a dict with ``name`` and that scheduler's
values; its value is a function of ``where``, the fraction of training done, in ``[0, 1)``:

============================  ==================================================================
``constant``                  ``value``
``linear``                    ``end_value * where + start_value * (1 - where)``
``cosine``                    ``end_value + (start_value - end_value) * (1 + cos(pi * where)) / 2``
``polynomial``                ``base_value * (1 - where) ** power``
``multistep``                 ``values[bisect_right(milestones, int((where + 1e-6) * num_epochs))]``
                              (milestones in epochs; default: evenly spaced, ``ceil(num_epochs / n)``)
``step``                      ``values[int((where + 1e-6) * len(values))]``
``step_with_fixed_gamma``     ``step`` over ``[base_value * gamma ** i for i in range(num_decays + 1)]``
``composite``                 ``schedulers[i]`` for the ``i`` whose share of ``lengths`` holds
                              ``where``; ``interval_scaling[i] == 'rescaled'`` (default) runs it on
                              ``(where - start) / lengths[i]``, ``'fixed'`` on ``where`` itself
============================  ==================================================================

:func:`check_schedule` validates a schedule where the config is read (one line naming the key) and
returns it normalised; :func:`schedule_value` evaluates it; :func:`auto_scale_schedule` is VISSL's
``auto_lr_scaling`` (``vissl.utils.hydra_config.infer_learning_rate``), which VISSL applies when it
reads a config. No torch here: the translator and :class:`memfit.optim.scheduler.vissl.VisslLR`
both use these functions.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

from memfit.config.schema import suggest
from memfit.errors import ConfigError

WHERE_EPSILON = 1e-6  # ClassyVision's: a step that lands a hair before a boundary counts as on it

# name -> (required keys, optional keys); num_epochs is given by OPTIMIZER.num_epochs in VISSL.
SCHEDULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "constant": (("value",), ()),
    "linear": (("start_value", "end_value"), ()),
    "cosine": (("start_value", "end_value"), ()),
    "polynomial": (("base_value", "power"), ()),
    "multistep": (("values", "num_epochs"), ("milestones",)),
    "step": (("values", "num_epochs"), ()),
    "step_with_fixed_gamma": (("base_value", "num_decays", "gamma", "num_epochs"), ()),
    "composite": (("schedulers", "lengths"), ("interval_scaling",)),
}
# VISSL's own schedulers that memfit does not have, and what to write instead.
NOT_SUPPORTED = {
    "inverse_sqrt": "write it as a composite of 'linear' warm-up and 'polynomial' (power=-0.5 is not "
                    "ClassyVision's form) or give memfit's own param_scheduler",
    "cosine_warm_restart": "use memfit's CosineRestartLR (param_scheduler=dict(type='CosineRestartLR', ...))",
}
UPDATE_INTERVALS = ("step", "epoch")
# Keys every schedule may carry besides its own: VISSL merges its defaults into the lr dict, so a
# schedule holds the other schedulers' values too (ignored, as ClassyVision ignores them).
COMMON_KEYS = ("name", "update_interval", "num_epochs", "auto_lr_scaling", "values", "milestones", "schedulers",
               "interval_scaling", "lengths", "start_value", "end_value", "value", "base_value", "num_decays",
               "gamma", "power")


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r}: must be a number")
    return float(value)


def check_schedule(cfg: Mapping[str, Any], key: str, num_epochs: int | None = None) -> dict[str, Any]:
    """Validate a VISSL schedule and return it with only its own keys, numbers as floats, composite
    ``lengths`` fixed to sum to 1 and ``interval_scaling`` filled (ClassyVision's ``from_config``).

    ``num_epochs`` is used where the schedule needs it and does not give it (VISSL injects
    ``OPTIMIZER.num_epochs``). Errors are one ``ConfigError`` line naming ``key``.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{key} must be a dict with 'name', got {type(cfg).__name__} {cfg!r}")
    name = cfg.get("name")
    if name in NOT_SUPPORTED:
        raise ConfigError(f"{key}.name={name!r}: VISSL's own scheduler, not in memfit: {NOT_SUPPORTED[name]}")
    if name not in SCHEDULES:
        raise ConfigError(f"{key}.name={name!r}: not a VISSL/ClassyVision scheduler: "
                          f"{suggest(str(name), SCHEDULES)}")
    unknown = [k for k in cfg if k not in COMMON_KEYS]
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: not a key of VISSL's {name!r} schedule: "
                          f"{suggest(str(unknown[0]), COMMON_KEYS)}")
    required, optional = SCHEDULES[name]
    cfg = dict(cfg)
    if "num_epochs" in required and cfg.get("num_epochs") is None and num_epochs is not None:
        cfg["num_epochs"] = num_epochs
    for k in required:
        if cfg.get(k) is None or (k in ("values", "schedulers", "lengths") and not cfg[k]):
            raise ConfigError(f"{key}.{k} is required by the {name!r} schedule")
    out: dict[str, Any] = {"name": name}
    interval = cfg.get("update_interval")
    if interval is not None:
        if interval not in UPDATE_INTERVALS:
            raise ConfigError(f"{key}.update_interval={interval!r}: use 'step' or 'epoch'")
        out["update_interval"] = interval
    for k in ("value", "start_value", "end_value", "base_value", "power", "gamma"):
        if k in required:
            out[k] = _number(cfg[k], f"{key}.{k}")
    for k in ("num_epochs", "num_decays"):
        if k in required:
            if isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] <= 0:
                raise ConfigError(f"{key}.{k}={cfg[k]!r}: must be an int > 0")
            out[k] = cfg[k]
    if "values" in required:
        out["values"] = [_number(v, f"{key}.values[{i}]") for i, v in enumerate(_list(cfg["values"], f"{key}.values"))]
    if name == "multistep":
        out["milestones"] = _milestones(cfg.get("milestones"), out["values"], out["num_epochs"], key)
    if name == "step_with_fixed_gamma" and (out["gamma"] <= 0 or out["base_value"] <= 0):
        raise ConfigError(f"{key}: step_with_fixed_gamma needs base_value > 0 and gamma > 0")
    if name == "composite":
        out.update(_composite(cfg, key, num_epochs))
    return out


def _list(value: Any, key: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r}: must be a list")
    return list(value)


def _milestones(milestones: Any, values: list[float], num_epochs: int, key: str) -> list[int]:
    if milestones is None or (isinstance(milestones, (list, tuple)) and not milestones and len(values) > 1):
        width = math.ceil(num_epochs / len(values))  # fvcore's default: evenly spaced drops
        milestones = [width * (i + 1) for i in range(len(values) - 1)]
    milestones = _list(milestones, f"{key}.milestones")
    if len(milestones) != len(values) - 1:
        raise ConfigError(f"{key}: {len(values)} values need {len(values) - 1} milestones, got {milestones}")
    start = 0
    for m in milestones:
        if isinstance(m, bool) or not isinstance(m, int) or m <= start or m >= num_epochs:
            raise ConfigError(f"{key}.milestones={milestones}: use increasing epochs in (0, num_epochs={num_epochs})")
        start = m
    return list(milestones)


def _composite(cfg: Mapping[str, Any], key: str, num_epochs: int | None) -> dict[str, Any]:
    subs = _list(cfg["schedulers"], f"{key}.schedulers")
    lengths = [_number(x, f"{key}.lengths[{i}]") for i, x in enumerate(_list(cfg["lengths"], f"{key}.lengths"))]
    if len(lengths) != len(subs):
        raise ConfigError(f"{key}: {len(subs)} schedulers need {len(subs)} lengths, got {len(lengths)}")
    if abs(sum(lengths) - 1.0) >= 1e-3:
        raise ConfigError(f"{key}.lengths={lengths}: the shares of training must sum to 1, not {sum(lengths):g}")
    lengths[-1] = 1.0 - sum(lengths[:-1])
    scaling = cfg.get("interval_scaling") or ["rescaled"] * len(subs)
    if len(scaling) != len(subs) or any(s not in ("rescaled", "fixed") for s in scaling):
        raise ConfigError(f"{key}.interval_scaling={scaling}: one of 'rescaled' or 'fixed' per scheduler")
    epochs = cfg.get("num_epochs", num_epochs)
    checked = [check_schedule(s, f"{key}.schedulers[{i}]", epochs) for i, s in enumerate(subs)]
    for sub in checked:
        sub.pop("update_interval", None)  # the composite's own interval decides
    return {"schedulers": checked, "lengths": lengths, "interval_scaling": list(scaling)}


def schedule_value(cfg: Mapping[str, Any], where: float) -> float:
    """The value of a schedule checked by :func:`check_schedule` at ``where`` in [0, 1)."""
    name = cfg["name"]
    if name == "constant":
        return cfg["value"]
    if name == "linear":
        return cfg["end_value"] * where + cfg["start_value"] * (1 - where)
    if name == "cosine":
        return cfg["end_value"] + 0.5 * (cfg["start_value"] - cfg["end_value"]) * (1 + math.cos(math.pi * where))
    if name == "polynomial":
        return cfg["base_value"] * (1.0 - where) ** cfg["power"]
    if name == "multistep":
        epoch = int((where + WHERE_EPSILON) * cfg["num_epochs"])
        return cfg["values"][bisect.bisect_right(cfg["milestones"], epoch)]
    if name in ("step", "step_with_fixed_gamma"):
        values = cfg["values"] if name == "step" else [
            cfg["base_value"] * cfg["gamma"] ** i for i in range(cfg["num_decays"] + 1)]
        return values[min(int((where + WHERE_EPSILON) * len(values)), len(values) - 1)]
    # composite
    lengths, i = cfg["lengths"], 0
    running = lengths[0]
    while where + WHERE_EPSILON > running and i < len(lengths) - 1:
        i += 1
        running += lengths[i]
    inner = where
    if cfg["interval_scaling"][i] == "rescaled":
        inner = (where - (running - lengths[i])) / lengths[i]
    return schedule_value(cfg["schedulers"][i], inner)


def auto_scale_schedule(lr: Mapping[str, Any], *, batch_size_per_replica: int, num_nodes: int,
                        num_proc_per_node: int, key: str = "OPTIMIZER.param_schedulers.lr") -> dict[str, Any]:
    """VISSL's ``auto_lr_scaling``: the schedule with its values set for the global batch.

    ``scaled_lr = base_value * global_batch / base_lr_batch_size`` (``scaling_type: sqrt``: the square
    root of that ratio), with ``global_batch = BATCHSIZE_PER_REPLICA * NUM_NODES * NUM_PROC_PER_NODE``
    (the config's, as VISSL reads them). Then, per schedule: cosine starts at ``scaled_lr`` and ends at
    ``scaled_lr * end/start``; multistep/step values become ``scaled_lr * gamma ** i`` with
    ``gamma = values[1] / values[0]``; step_with_fixed_gamma's base_value, linear's end_value and
    constant's value become ``scaled_lr``; a composite scales each part, and its linear warm-up starts
    at the lr of one node's batch (on one node the warm-up is dropped when it would not rise).
    ``auto_lr_scaling`` itself is removed from the result. A schedule without ``auto_scale: true`` is
    returned unchanged (minus the ``auto_lr_scaling`` entry).
    """
    lr = dict(lr)
    scaling = dict(lr.pop("auto_lr_scaling", None) or {})
    if not scaling.get("auto_scale", False):
        return lr
    where = f"{key}.auto_lr_scaling"
    base_value = _number(scaling.get("base_value", 0.1), f"{where}.base_value")
    base_batch = _number(scaling.get("base_lr_batch_size", 256), f"{where}.base_lr_batch_size")
    kind = scaling.get("scaling_type", "linear")
    if kind not in ("linear", "sqrt"):
        raise ConfigError(f"{where}.scaling_type={kind!r}: use 'linear' or 'sqrt'")
    factor = batch_size_per_replica * num_nodes * num_proc_per_node / base_batch
    scaled = base_value * (math.sqrt(factor) if kind == "sqrt" else factor)
    node_lr = base_value * batch_size_per_replica * num_proc_per_node / base_batch
    return _scaled(lr, scaled, node_lr, num_nodes, key)


def _scaled(lr: dict[str, Any], scaled: float, node_lr: float, num_nodes: int, key: str) -> dict[str, Any]:
    name = lr.get("name")
    if name == "cosine":
        if not lr["start_value"]:
            raise ConfigError(f"{key}: auto_lr_scaling scales a cosine by end_value/start_value: start_value is 0")
        lr["end_value"] = scaled * (lr["end_value"] / lr["start_value"])
        lr["start_value"] = float(scaled)
    elif name in ("multistep", "step"):
        values = lr["values"]
        gamma = round(values[1] / values[0], 6) if len(values) > 1 else 1.0
        lr["values"] = [round(float(scaled * gamma**i), 8) for i in range(len(values))]
    elif name == "step_with_fixed_gamma":
        lr["base_value"] = scaled
    elif name == "linear":
        lr["end_value"] = scaled
    elif name == "constant":
        lr["value"] = scaled
    elif name == "composite":
        subs = [_scaled(dict(s), scaled, node_lr, num_nodes, key) for s in lr["schedulers"]]
        lr["schedulers"] = subs
        if any(s.get("name") == "linear" for s in subs):
            return _resolve_warmup(lr, node_lr, num_nodes, key)
    else:
        raise ConfigError(f"{key}: auto_lr_scaling cannot scale a {name!r} schedule (VISSL scales cosine, "
                          "multistep, step, step_with_fixed_gamma, linear, constant and composite)")
    return lr


def _resolve_warmup(lr: dict[str, Any], node_lr: float, num_nodes: int, key: str) -> dict[str, Any]:
    """VISSL's ``resolve_linear_schedule``: a linear part starts at one node's lr; on one node a
    warm-up that would not rise is dropped, and a single remaining scheduler replaces the composite."""
    drop = -1
    for i, sub in enumerate(lr["schedulers"]):
        if sub.get("name") == "linear":
            sub["start_value"] = node_lr
            if num_nodes == 1 and node_lr <= sub["end_value"]:
                drop = i
    if drop >= 0:
        del lr["schedulers"][drop]
        if len(lr["schedulers"]) > 1:
            raise ConfigError(f"{key}: auto_lr_scaling drops the linear warm-up on one node (VISSL's rule), "
                              f"which leaves {len(lr['schedulers'])} schedulers for {len(lr['lengths'])} lengths: "
                              "remove the warm-up from the config or set auto_scale: false")
    if len(lr["schedulers"]) == 1:
        only = lr["schedulers"][0]
        lr = {k: v for k, v in lr.items() if k not in ("schedulers", "lengths", "interval_scaling")}
        lr.update({k: v for k, v in only.items() if k != "update_interval"})
    return lr
