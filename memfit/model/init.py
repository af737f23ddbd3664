"""``init_cfg``: MMEngine's weight initialisation, declared on a model (or any submodule) and applied
by the runner before training (``BaseModel.init_weights``).

``dict(type='Pretrained', checkpoint='backbone.pth', prefix='backbone.')`` loads a local file
(non-strict: what does not match is logged); ``Constant``, ``Normal``, ``TruncNormal``,
``Uniform``, ``Xavier`` and ``Kaiming`` set the ``weight`` (and ``bias``) of every module, or of the
module classes named in ``layer``, with ``torch.nn.init``. A list applies in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from memfit.errors import ConfigError, did_you_mean

logger = logging.getLogger("memfit")

# type -> (weight initialiser taking the init_cfg's keyword arguments, the keywords it takes)
_INITS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "Constant": (lambda w, val=0.0: nn.init.constant_(w, val), ("val",)),
    "Normal": (lambda w, mean=0.0, std=1.0: nn.init.normal_(w, mean, std), ("mean", "std")),
    "TruncNormal": (lambda w, mean=0.0, std=1.0, a=-2.0, b=2.0: nn.init.trunc_normal_(w, mean, std, a, b),
                    ("mean", "std", "a", "b")),
    "Uniform": (lambda w, a=0.0, b=1.0: nn.init.uniform_(w, a, b), ("a", "b")),
    "Xavier": (lambda w, gain=1.0, distribution="normal": (nn.init.xavier_uniform_ if distribution == "uniform"
                                                            else nn.init.xavier_normal_)(w, gain),
               ("gain", "distribution")),
    "Kaiming": (lambda w, a=0.0, mode="fan_out", nonlinearity="relu", distribution="normal":
                (nn.init.kaiming_uniform_ if distribution == "uniform" else nn.init.kaiming_normal_)(
                    w, a=a, mode=mode, nonlinearity=nonlinearity), ("a", "mode", "nonlinearity", "distribution")),
}


def init_weights(module: nn.Module, init_cfg: dict | list, key: str = "init_cfg") -> None:
    """Apply ``init_cfg`` (a dict or a list of dicts) to ``module``; errors name ``key``."""
    for i, cfg in enumerate(init_cfg if isinstance(init_cfg, list | tuple) else [init_cfg]):
        where = f"{key}[{i}]" if isinstance(init_cfg, list | tuple) else key
        if not isinstance(cfg, dict) or "type" not in cfg:
            raise ConfigError(f"{where}={cfg!r}: use dict(type='Pretrained', checkpoint=...) or "
                              "dict(type='Normal', ...)")
        cfg = dict(cfg)
        kind = cfg.pop("type")
        if kind == "Pretrained":
            _pretrained(module, where, **cfg)
            continue
        if kind not in _INITS:
            raise ConfigError(f"{where}.type={kind!r}: {did_you_mean(str(kind), ['Pretrained', *_INITS])}")
        fn, accepted = _INITS[kind]
        layer, bias = cfg.pop("layer", None), cfg.pop("bias", 0.0)
        unknown = sorted(set(cfg) - set(accepted))
        if unknown:
            raise ConfigError(f"{where}: {kind} takes no {unknown[0]!r}: {did_you_mean(unknown[0], accepted)}")
        _apply(module, partial(fn, **cfg), bias, [layer] if isinstance(layer, str) else layer)


def _apply(module: nn.Module, init: Callable[[Any], Any], bias: float, layers: list[str] | None) -> None:
    for m in module.modules():
        if layers is not None and not any(c.__name__ in layers for c in type(m).__mro__):
            continue
        weight, b = getattr(m, "weight", None), getattr(m, "bias", None)
        if isinstance(weight, nn.Parameter):
            init(weight.data)
        if isinstance(b, nn.Parameter) and isinstance(weight, nn.Parameter):
            nn.init.constant_(b.data, bias)


def _pretrained(module: nn.Module, where: str, checkpoint: str | None = None, prefix: str | None = None,
                map_location: Any = "cpu", **unknown: Any) -> None:
    from memfit.checkpoint import load_weights

    if unknown:
        raise ConfigError(f"{where}: Pretrained takes no {sorted(unknown)[0]!r}: use checkpoint=, prefix=, "
                          "map_location=")
    if not checkpoint:
        raise ConfigError(f"{where}: Pretrained needs checkpoint='path/to/weights.pth' (a local file)")
    if prefix and not prefix.endswith("."):
        prefix += "."  # MMEngine's prefix names a submodule: 'backbone' == 'backbone.'
    missing, unexpected = load_weights(module, checkpoint, strict=False, prefix=prefix, map_location=map_location)
    logger.info(f"{where}: loaded {checkpoint}" + (f" (prefix {prefix!r})" if prefix else "")
                + (f"; {len(missing)} missing, {len(unexpected)} unexpected keys" if missing or unexpected else ""))


def init_model_weights(model: nn.Module) -> list[str]:
    """Apply the ``init_cfg`` of ``model`` and of every submodule that declares one (MMEngine's
    BaseModule convention), outermost first; return the names of the modules initialised."""
    done = []
    for name, m in model.named_modules():
        cfg = getattr(m, "init_cfg", None)
        if cfg:
            init_weights(m, cfg, key=f"{name}.init_cfg" if name else "model.init_cfg")
            done.append(name)
    return done
