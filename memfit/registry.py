"""Registries: turn ``dict(type='AdamW', lr=1e-3)`` into an object.

``type`` is a registered name, a class or any callable. Keyword arguments are checked against the
callable's signature before the call, so a misspelt key fails with the key and the nearest valid one
instead of a ``TypeError`` from deep inside torch.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, MemfitError, component_error, did_you_mean


class Registry:
    """A name -> callable table with lazy fall-backs (e.g. every ``torch.optim`` class)."""

    def __init__(self, name: str, lazy: Callable[[], dict[str, Any]] | None = None) -> None:
        self.name = name
        self._table: dict[str, Any] = {}
        self._lazy = lazy
        self._lazy_loaded = False

    def register(self, obj: Any = None, *, name: str | None = None, force: bool = False) -> Any:
        """Register ``obj`` under ``name`` (default: its ``__name__``); usable as a decorator."""

        def add(o: Any) -> Any:
            key = name or o.__name__
            if key in self._table and self._table[key] is not o and not force:
                raise KeyError(f"{key!r} is already registered in the {self.name} registry")
            self._table[key] = o
            return o

        return add if obj is None else add(obj)

    def _names(self) -> dict[str, Any]:
        if self._lazy is not None and not self._lazy_loaded:
            self._lazy_loaded = True
            for key, value in self._lazy().items():
                self._table.setdefault(key, value)
        return self._table

    def get(self, name: str, key: str | None = None) -> Any:
        """Look ``name`` up; an unknown name raises ConfigError listing the nearest names (prefixed
        with ``key``, the config entry it came from, when given)."""
        table = self._names()
        if name in table:
            return table[name]
        if "." in name:  # a dotted import path, as YAML dumps write classes: 'torch.optim.AdamW'
            obj = _import_path(name)
            if obj is not None:
                return obj
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}unknown {self.name} type {name!r}: {did_you_mean(name, table)}")

    def __contains__(self, name: str) -> bool:
        return name in self._names()

    def names(self) -> list[str]:
        return sorted(self._names())

    def build(self, cfg: Any, *, key: str | None = None, **defaults: Any) -> Any:
        """Build ``cfg`` (a dict with ``type``); objects that are not dicts are returned as they are.

        ``defaults`` fill arguments the config does not set (e.g. ``params`` for an optimizer).
        ``key`` names the config section in error messages (``optim_wrapper.optimizer``). Anything
        the constructor raises becomes one ConfigError (a ConfigTypeError from a TypeError),
        ``<key>: <first line> (<type name>)``, with the original as ``__cause__``; a ConfigError from a
        nested build that names no config key gets ``<key>: `` in front; other memfit errors and
        KeyboardInterrupt pass unchanged.
        """
        if not isinstance(cfg, dict):
            return cfg
        cfg = dict(cfg)
        where = key or self.name
        if "type" not in cfg:
            raise ConfigError(f"{where}: missing 'type' (one of: {', '.join(self.names()[:10])}, ...)")
        kind = cfg.pop("type")
        target = self.get(kind, where) if isinstance(kind, str) else kind
        name = getattr(target, "__name__", None) or type(target).__name__
        kwargs = {**defaults, **cfg}
        check_kwargs(target, kwargs, key or f"{self.name} {name}")
        try:
            return target(**kwargs)
        except ConfigError as exc:
            if key and not str(exc).startswith(re.split(r"[.\[ ]", key)[0]):
                exc.args = (f"{key}: {exc}", *exc.args[1:])
            raise
        except MemfitError:
            raise
        except Exception as exc:
            missing = _missing_arguments(target, kwargs) if isinstance(exc, TypeError) else []
            if missing:  # Python's (and MMEngine's) TypeError for a missing argument
                raise ConfigTypeError(f"{where}: {name} needs {', '.join(map(repr, missing))}: add "
                                  f"{', '.join(f'{where}.{m}=...' for m in missing)}") from exc
            raise component_error(where, name, exc) from exc


def check_kwargs(target: Callable, kwargs: dict[str, Any], where: str) -> None:
    """Raise ConfigTypeError if ``kwargs`` holds a key ``target`` does not accept (the TypeError Python,
    and so MMEngine's build, raises for an unexpected keyword argument)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for k in kwargs:
        if k not in valid:
            raise ConfigTypeError(f"{where}: unknown key {k!r}: {did_you_mean(k, valid)}")


def _missing_arguments(target: Callable, kwargs: dict[str, Any]) -> list[str]:
    """The required keyword-passable parameters of ``target`` that ``kwargs`` leaves out."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in params.items() if p.kind in kinds and p.default is p.empty and n not in kwargs]


def _import_path(path: str) -> Any:
    import importlib

    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def _torchvision_models() -> dict[str, Any]:
    """torchvision's model builders by name (resnet18, ...), e.g. as an ImageClassifier backbone."""
    import torchvision

    return {name: torchvision.models.get_model_builder(name) for name in torchvision.models.list_models()}


def _torch_optimizers() -> dict[str, Any]:
    import torch.optim

    table = {
        n: getattr(torch.optim, n)
        for n in dir(torch.optim)
        if inspect.isclass(getattr(torch.optim, n)) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
    }
    try:  # timm's optimizers (Lars/Larc, Lamb, AdamP, ...) when timm is installed
        import timm.optim

        for n in dir(timm.optim):
            obj = getattr(timm.optim, n)
            if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer):
                table.setdefault(n, obj)
    except ImportError:
        pass
    return table


def _torchvision_transforms() -> dict[str, Any]:
    import torchvision.transforms.v2 as T

    return {n: getattr(T, n) for n in dir(T) if inspect.isclass(getattr(T, n))}


def _collate_fns() -> dict[str, Any]:
    from torch.utils.data import default_collate

    return {"default_collate": default_collate, "pseudo_collate": pseudo_collate}


def pseudo_collate(batch: Sequence) -> Any:
    """MMEngine's pseudo_collate: transpose the batch without stacking anything (images of different
    sizes, variable numbers of boxes).

    Dict samples give a dict of lists (``[{'inputs': a, 'data_samples': x}, ...]`` ->
    ``{'inputs': [a, ...], 'data_samples': [x, ...]}``); tuples and lists give a list of lists
    (named tuples stay named tuples); anything else is returned as the list of samples. One level
    only: memfit's data samples are plain dicts, which MMEngine's recursion would transpose too
    (its DetDataSample objects are not mappings, so there it stops at the same place).
    """
    item = batch[0]
    if isinstance(item, Mapping):
        return type(item)({key: [sample[key] for sample in batch] for key in item})
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
        return type(item)(*(list(field) for field in zip(*batch)))
    if isinstance(item, (tuple, list)):
        if any(len(sample) != len(item) for sample in batch):
            raise ValueError("pseudo_collate: every sample in a batch must have the same length")
        return [list(column) for column in zip(*batch)]
    return list(batch)


MODELS = Registry("model", _torchvision_models)
OPTIMIZERS = Registry("optimizer", _torch_optimizers)
OPTIM_WRAPPERS = Registry("optim_wrapper")
OPTIM_WRAPPER_CONSTRUCTORS = Registry("optim_wrapper_constructor")
# memfit.optim.scheduler registers MMEngine's schedulers; torch's are refused by name there.
PARAM_SCHEDULERS = Registry("param_scheduler")
STRATEGIES = Registry("strategy")
HOOKS = Registry("hook")
DATASETS = Registry("dataset")
TRANSFORMS = Registry("transform", _torchvision_transforms)
# MMDetection's transform names (Resize, RandomCrop, ... on a sample dict with boxes), which clash
# with torchvision's: detection pipelines look here first, then in TRANSFORMS (memfit.data.det_transforms).
DET_TRANSFORMS = Registry("detection transform")
DATA_SAMPLERS = Registry("sampler")
COLLATE_FNS = Registry("collate_fn", _collate_fns)
METRICS = Registry("metric")


def copy_cfg(cfg: Any) -> Any:
    """A deep copy of a config value that leaves modules, classes and callables shared."""
    if isinstance(cfg, dict):
        return {k: copy_cfg(v) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [copy_cfg(v) for v in cfg]
    if isinstance(cfg, tuple):
        return tuple(copy_cfg(v) for v in cfg)
    return cfg if callable(cfg) or not _copyable(cfg) else copy.copy(cfg)


def _copyable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool, type(None)))
