"""Build a run's ``param_scheduler`` config: MMEngine's ``Runner.build_param_scheduler``.

The runner passes its train loop's facts. A scheduler's ``by_epoch`` defaults to the run's (MMEngine
defaults it to True, which never steps inside an iteration-based run); ``end`` defaults to
``max_epochs`` or ``max_iters`` in the scheduler's own unit; ``convert_to_iter_based=True`` builds
an epoch-based config per iteration through ``build_iter_from_epoch``. Torch's own schedulers are
refused: they cannot hold a value still outside ``[begin, end)`` nor spread a change over
``end - begin - 1`` steps, so a config written for MMEngine would train differently.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean
from memfit.optim.scheduler.base import INF, ParamScheduler, check_epoch_length
from memfit.registry import PARAM_SCHEDULERS

# torch's name -> MMEngine's scheduler doing the same, named in the refusal.
_TORCH_EQUIVALENT = {"PolynomialLR": "PolyLR", "ReduceLROnPlateau": "ReduceOnPlateauLR",
                     "CosineAnnealingWarmRestarts": "CosineRestartLR"}


def build_param_schedulers(cfg: Any, optim_wrapper: Any, *, by_epoch_run: bool = True,
                           max_epochs: int | None = None, max_iters: int | None = None,
                           epoch_length: int | None = None) -> list | dict:
    """Schedulers for ``optim_wrapper`` from ``cfg`` (a dict, a list of dicts or built schedulers).

    With several optimizers (an ``OptimWrapperDict``: ``optim_wrappers`` and ``items()``) the
    result is a dict name -> list: ``cfg`` keyed by optimizer name gives each its own, any other
    ``cfg`` is built once for every optimizer.
    """
    if cfg is None:
        return []
    facts = dict(by_epoch_run=by_epoch_run, max_epochs=max_epochs, max_iters=max_iters, epoch_length=epoch_length)
    wrappers = getattr(optim_wrapper, "optim_wrappers", None)
    if wrappers is None:
        return _build_list(cfg, optim_wrapper, "param_scheduler", facts)
    per_name = isinstance(cfg, dict) and "type" not in cfg
    if per_name:
        for name in cfg:
            if name not in wrappers:
                raise ConfigError(f"param_scheduler: no optimizer named {name!r}: {did_you_mean(name, wrappers)}")
    return {name: _build_list(cfg.get(name, []) if per_name else cfg, wrapper,
                              f"param_scheduler.{name}" if per_name else "param_scheduler", facts)
            for name, wrapper in optim_wrapper.items()}


def _build_list(cfg: Any, optim_wrapper: Any, key: str, facts: dict) -> list:
    if isinstance(cfg, (list, tuple)):
        return [_build_one(item, optim_wrapper, f"{key}[{i}]", **facts) for i, item in enumerate(cfg)]
    return [_build_one(cfg, optim_wrapper, key, **facts)]


def _build_one(item: Any, optim_wrapper: Any, key: str, *, by_epoch_run: bool, max_epochs: int | None,
               max_iters: int | None, epoch_length: int | None) -> Any:
    if isinstance(item, ParamScheduler):
        return item
    if not isinstance(item, dict):  # MMEngine: TypeError
        raise ConfigTypeError(f"{key}: expected a dict with 'type' (or a built ParamScheduler), "
                              f"got {type(item).__name__}")
    item = dict(item)
    kind = item.pop("type", None)
    if kind is None:
        raise ConfigError(f"{key}: missing 'type' (e.g. 'LinearLR', 'CosineAnnealingLR', 'MultiStepLR')")
    cls = scheduler_class(kind, key)
    convert = item.pop("convert_to_iter_based", False)
    # ReduceOnPlateau is epoch-based only: it judges validation metrics.
    by_epoch = item.setdefault("by_epoch", bool(convert or getattr(cls, "need_val_args", False) or by_epoch_run))
    if convert and not by_epoch:
        raise ConfigError(f"{key}: convert_to_iter_based=True converts an epoch-based schedule: drop by_epoch=False")
    if convert:  # MMEngine checks the epoch length before any other argument
        try:
            check_epoch_length(epoch_length)
        except ConfigError as exc:
            raise type(exc)(f"{key}.convert_to_iter_based: {exc}") from None
    total = max_epochs if by_epoch else max_iters
    end_given = "end" in item
    begin, end = item.setdefault("begin", 0), item.setdefault("end", INF if total is None else total)
    for arg, value in (("begin", begin), ("end", end)):
        unit = "epochs" if by_epoch else "iterations"
        if type(value) is not int:
            raise ConfigTypeError(f"{key}.{arg}={value!r}: got {type(value).__name__}: use an int >= 0 ({unit})")
        if value < 0:
            raise ConfigError(f"{key}.{arg}={value!r}: use an int >= 0 ({unit})")
    if end <= begin:
        if end_given:
            raise ConfigError(f"{key}: end={end} is not after begin={begin}: the scheduler would never step")
        source, fix = _run_length(by_epoch, by_epoch_run, max_epochs, epoch_length)
        raise ConfigError(f"{key}: end={end}{source} is not after begin={begin}: the run ends before the scheduler "
                          f"starts: {fix}")
    target = _iter_based(cls, epoch_length, key) if convert else cls
    # The registry checks the keys against the signature and turns constructor errors into
    # '<key>: <cause> (<Type>)'.
    try:
        return PARAM_SCHEDULERS.build({"type": target, **item}, key=key, optimizer=optim_wrapper)
    except ConfigError as exc:
        # A TypeError the constructor raised (an argument of the wrong type, as MMEngine's would raise)
        # stays a TypeError: the same one line, as a ConfigTypeError.
        if isinstance(exc.__cause__, TypeError) and not isinstance(exc, TypeError):
            raise ConfigTypeError(str(exc)) from exc.__cause__
        raise


def _run_length(by_epoch: bool, by_epoch_run: bool, max_epochs: int | None,
                epoch_length: int | None) -> tuple[str, str]:
    """Where a default ``end`` came from (the run's length in the scheduler's unit) and the fix."""
    if by_epoch:
        return " (end not set: train_cfg.max_epochs)", "lower begin or raise train_cfg.max_epochs"
    if by_epoch_run and max_epochs is not None and epoch_length is not None:
        return (f" = {max_epochs} epochs x {epoch_length} iterations (end not set: the run's length)",
                "lower begin, or count it in epochs (by_epoch=True, convert_to_iter_based=True, begin=0) "
                "so that it follows the run's length")
    return " (end not set: train_cfg.max_iters)", "lower begin or raise train_cfg.max_iters"


def scheduler_class(kind: Any, key: str) -> Any:
    """The class ``type`` names; torch's own schedulers are refused in one line naming MMEngine's."""
    torch_cls = getattr(torch.optim.lr_scheduler, kind, None) if isinstance(kind, str) else kind
    if getattr(torch_cls, "__module__", None) == "torch.optim.lr_scheduler" and inspect.isclass(torch_cls) \
            and not (isinstance(kind, str) and kind in PARAM_SCHEDULERS):
        instead = _TORCH_EQUIVALENT.get(torch_cls.__name__, "LinearLR, CosineAnnealingLR, MultiStepLR, ...")
        raise ConfigError(f"{key}: {torch_cls.__name__} is torch's scheduler, which ignores MMEngine's "
                          f"[begin, end): use MMEngine's ({instead}) or a ParamScheduler subclass")
    if not (isinstance(kind, str) or callable(kind)):  # MMEngine: TypeError
        raise ConfigTypeError(f"{key}.type={kind!r}: got {type(kind).__name__}: use a scheduler's name "
                              "(e.g. 'LinearLR') or class")
    return PARAM_SCHEDULERS.get(kind, key) if isinstance(kind, str) else kind


def _iter_based(cls: Any, epoch_length: int | None, key: str) -> Any:
    """``cls.build_iter_from_epoch`` bound to ``epoch_length``, named and typed as ``cls`` for the
    registry's key check and error messages."""
    if not hasattr(cls, "build_iter_from_epoch"):
        raise ConfigError(f"{key}: convert_to_iter_based=True, but {cls.__name__} has no build_iter_from_epoch")

    def build(**kwargs: Any) -> Any:
        return cls.build_iter_from_epoch(epoch_length=epoch_length, **kwargs)

    build.__name__, build.__signature__ = cls.__name__, inspect.signature(cls)  # type: ignore[attr-defined]
    return build
