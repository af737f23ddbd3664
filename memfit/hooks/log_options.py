"""MMEngine's ``log_processor`` and ``visualizer`` read as :class:`~memfit.hooks.logger.LoggerHook` options.

``log_processor.window_size`` (an int) becomes the logger's smoothing window. ``visualizer.vis_backends``
decides TensorBoard: on when ``TensorboardVisBackend`` is listed, off otherwise; ``LocalVisBackend``
is the ``scalars.jsonl`` file memfit writes anyway. Every other option logs one warning naming it
(:func:`memfit.errors.warn_ignored`); an option set as memfit behaves anyway stays silent. The logger
hook's own MMEngine arguments (``interval_exp_name``, ``log_metric_by_epoch``, ``out_dir``, ...) are
:class:`~memfit.hooks.logger.LoggerHook`'s and pass through ``default_hooks.logger`` unchanged.
"""

from __future__ import annotations

from typing import Any

from memfit.config.schema import TrainCfg
from memfit.errors import warn_ignored
from memfit.hooks.logger import LoggerHook

_AVERAGED = "train scalars are averaged over window_size, except lr, loss_scale and skipped_steps (the latest value)"
_LOG_PROCESSOR_WHY = {  # key: (values memfit behaves as anyway, why others have no effect)
    "custom_cfg": ((None, [], ()), _AVERAGED + "; compute other statistics in a hook"),
    "mean_pattern": ((), _AVERAGED),
    "num_digits": ((4,), "the log line prints 4 decimals"),
    "log_with_hierarchy": ((False,), "scalars keep flat names (loss, lr; val/ for validation metrics)"),
}
_LOCAL, _TENSORBOARD = "LocalVisBackend", "TensorboardVisBackend"
_FILES = ("files go to work_dir/<timestamp>/ (scalars.jsonl, tensorboard/); default_hooks.logger.out_dir "
          "copies the logs to another folder after the run")


def logger_kwargs(log_processor: Any, visualizer: Any, by_epoch: bool | None = None) -> dict[str, Any]:
    """LoggerHook keyword arguments for MMEngine's ``log_processor`` and ``visualizer``; warns for the rest.

    ``by_epoch`` is the train loop's (None without a ``train_cfg``): the log line follows it, so
    ``log_processor.by_epoch`` warns only when it disagrees.
    """
    options: dict[str, Any] = {}
    for key, value in _entries(log_processor, "log_processor"):
        if key == "window_size" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            options["window_size"] = value
        elif key == "window_size":
            warn_ignored(f"log_processor.window_size={value!r}", "give a number of iterations (default: the "
                         "logger interval); 'epoch' and 'global' windows are not supported")
        elif key == "by_epoch":
            if by_epoch is not None and bool(value) != by_epoch:
                warn_ignored(f"log_processor.by_epoch={value}", f"the log line follows train_cfg.by_epoch={by_epoch}")
        elif key != "type":
            native, why = _LOG_PROCESSOR_WHY.get(key, ((), "memfit's LoggerHook has no such option"))
            if not any(value == v and type(value) is type(v) for v in native):
                warn_ignored(f"log_processor.{key}", why)
    for key, value in _entries(visualizer, "visualizer"):
        if key == "vis_backends":
            names = [_backend(b) for b in value or []]
            options["tensorboard"] = _TENSORBOARD in names
        elif key not in ("type", "name"):
            warn_ignored(f"visualizer.{key}", f"memfit draws no images and logs scalars only; {_FILES}")
    return options


def log_options(default_hooks: dict | None, log_processor: Any, visualizer: Any, train_cfg: dict | None = None,
                cfg: dict | None = None) -> dict:
    """``default_hooks`` with :func:`logger_kwargs` under the logger hook's config (keys set there win).

    ``cfg``: the runner's ``cfg``; its ``vis_backends`` (a config's top-level helper variable) is used
    when no ``visualizer`` is given. A logger hook that is removed (None), an object or of another type is
    left as it is.
    """
    if visualizer is None and (cfg or {}).get("vis_backends") is not None:
        visualizer = dict(vis_backends=cfg["vis_backends"])
    by_epoch = None if train_cfg is None else TrainCfg.from_dict(train_cfg, "train_cfg").by_epoch
    options = logger_kwargs(log_processor, visualizer, by_epoch)
    hooks = dict(default_hooks or {})
    logger = hooks.get("logger", {})
    if options and isinstance(logger, dict) and logger.get("type", "LoggerHook") in ("LoggerHook", LoggerHook):
        hooks["logger"] = {**options, **logger}
    return hooks


def _entries(cfg: Any, key: str) -> list[tuple[str, Any]]:
    if cfg is None:
        return []
    if not isinstance(cfg, dict):
        warn_ignored(f"{key}={type(cfg).__name__}(...)", f"give a dict, as MMEngine configs do; {_FILES}")
        return []
    return list(cfg.items())


def _backend(cfg: Any) -> str:
    """The backend's type name; warns for backends memfit has no writer for, and for their options."""
    kind = cfg.get("type") if isinstance(cfg, dict) else cfg
    name = (kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))).rsplit(".", 1)[-1]
    if name not in (_LOCAL, _TENSORBOARD):
        warn_ignored(f"{name} in visualizer.vis_backends", f"memfit writes scalars.jsonl ({_LOCAL}) and TensorBoard "
                     f"({_TENSORBOARD}) only; read scalars.jsonl or log from a custom hook")
    elif isinstance(cfg, dict):
        for option in sorted(set(cfg) - {"type"}):
            warn_ignored(f"{name}.{option} in visualizer.vis_backends", _FILES)
    return name
