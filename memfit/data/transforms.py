"""Image pipelines from config: a list of ``dict(type=<torchvision.transforms.v2 name>, ...)``.

Names resolve through the TRANSFORMS registry (every ``torchvision.transforms.v2`` class, plus
anything registered there), so ``dict(type='RandomResizedCrop', size=64)`` builds
``v2.RandomResizedCrop(size=64)``. Config files hold strings, so a ``dtype`` given as a string
(``'float32'`` or ``'torch.float32'``) becomes the torch dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchvision.transforms.v2 as T

from memfit.errors import ConfigError
from memfit.registry import TRANSFORMS


def _dtype(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    name = value.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{where}: dtype={value!r} is not a torch dtype: use e.g. 'float32' or 'uint8'")
    return dtype


def build_transform(cfg: dict | Callable, where: str = "pipeline") -> Callable:
    """Build one transform from ``dict(type=..., **kwargs)``; a callable is returned as it is."""
    if callable(cfg) and not isinstance(cfg, dict):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected dict(type=...) or a callable, got {type(cfg).__name__}")
    cfg = dict(cfg)
    if "dtype" in cfg:
        cfg["dtype"] = _dtype(cfg["dtype"], where)
    return TRANSFORMS.build(cfg, key=f"{where} {cfg.get('type')}")


def build_transforms(cfg_list: Sequence[dict | Callable] | Callable | None) -> Callable | None:
    """Compose a list of transform configs (or callables) with ``v2.Compose``.

    ``None`` or ``[]`` gives ``None`` (no transform); a single callable is returned unchanged. The pipeline is
    applied to the image of a sample (the ``img`` key); boxes are not transformed with it.
    """
    if cfg_list is None or (callable(cfg_list) and not isinstance(cfg_list, (list, tuple))):
        return cfg_list
    if isinstance(cfg_list, dict):
        cfg_list = [cfg_list]
    if not isinstance(cfg_list, (list, tuple)):
        raise ConfigError(f"pipeline: expected a list of dict(type=...), got {type(cfg_list).__name__}")
    if not cfg_list:
        return None
    return T.Compose([build_transform(c, f"pipeline[{i}]") for i, c in enumerate(cfg_list)])


def default_image_transform() -> Callable:
    """uint8 CHW image -> float32 in [-1, 1]: the pipeline datasets use when none is given."""
    return T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize([0.5], [0.5])])
