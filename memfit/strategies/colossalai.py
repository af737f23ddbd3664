"""ColossalAIStrategy: train through colossalai's Booster with its Gemini, LowLevelZero or DDP plugin.

The seeds' config is ``strategy=dict(type='ColossalAIStrategy', plugin='gemini'|'lowlevel-zero'|'ddp',
mixed_precision='fp16'|'bf16')`` with ``optim_wrapper=dict(optimizer=dict(type='HybridAdam', lr=...))``.
What runs where (colossalai 0.5.0 under torch 2.14; see docs/colossalai.md): on CPU only the DDP
plugin works as shipped. LowLevelZero asserts a CUDA/NPU device, Gemini and HybridAdam need CUDA
(HybridAdam's CPU kernel does not build against torch 2.14's headers), so those combinations are
refused on CPU with a one-line error instead of failing deep inside colossalai.

memfit joins the process group itself (colossalai's ``launch_from_torch`` no longer takes the
``config=`` that MMEngine's strategy passes). The DDP plugin's model and optimizer hold full state on
every rank, so its checkpoints are memfit's own single file; Gemini/LowLevelZero shard the optimizer
and write through the booster's sharded checkpoint I/O into a directory renamed into place atomically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.errors import ConfigError
from memfit.optim.wrapper import AmpOptimWrapper, OptimWrapper
from memfit.registry import OPTIMIZERS, STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.wrapped import StepThroughWrapper

logger = logging.getLogger("memfit")

# The seeds' plugin names (and colossalai's class names) -> colossalai plugin class names.
PLUGINS = {"gemini": "GeminiPlugin", "lowlevel-zero": "LowLevelZeroPlugin", "low_level_zero": "LowLevelZeroPlugin",
           "ddp": "TorchDDPPlugin", "torch_ddp": "TorchDDPPlugin", "GeminiPlugin": "GeminiPlugin",
           "LowLevelZeroPlugin": "LowLevelZeroPlugin", "TorchDDPPlugin": "TorchDDPPlugin"}
_SHARDED = ("GeminiPlugin", "LowLevelZeroPlugin")
_PRECISIONS = ("fp16", "bf16", "fp32")


def import_colossalai() -> Any:
    try:
        import colossalai
        import colossalai.booster  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"ColossalAIStrategy needs colossalai: pip install 'memfit[colossalai]' ({exc})") from None
    return colossalai


def register_hybrid_adam() -> None:
    """Make ``optimizer=dict(type='HybridAdam')`` resolvable; called when a ColossalAIStrategy is built
    (HybridAdam imports colossalai, so it cannot be registered at memfit's import)."""
    if "HybridAdam" in OPTIMIZERS:
        return
    from colossalai.nn.optimizer import HybridAdam

    OPTIMIZERS.register(HybridAdam, name="HybridAdam")


@STRATEGIES.register()
class ColossalAIStrategy(Strategy):
    """``plugin``: 'gemini', 'lowlevel-zero', 'ddp', a plugin class name, or ``dict(type=..., **kwargs)``
    for the plugin's own options. ``mixed_precision``: 'fp16'/'bf16' (the sharded plugins' ``precision``;
    torch autocast through an AmpOptimWrapper for the DDP plugin) or None for fp32."""

    def __init__(self, plugin: str | dict = "gemini", mixed_precision: str | None = None,
                 config: Any = None, model_wrapper: dict | None = None) -> None:
        super().__init__()
        if config is not None:
            raise ConfigError("strategy.config: colossalai's launch no longer takes a config; remove it")
        if model_wrapper is not None:
            raise ConfigError("strategy.model_wrapper: the plugin wraps the model; give its options in "
                              "plugin=dict(type=..., ...)")
        kwargs = dict(plugin) if isinstance(plugin, Mapping) else {"type": plugin}
        kind = kwargs.pop("type", "gemini")
        kind = getattr(kind, "__name__", kind)
        if kind not in PLUGINS:
            from memfit.errors import did_you_mean

            hint = did_you_mean(str(kind), ["gemini", "lowlevel-zero", "ddp"])
            raise ConfigError(f"strategy.plugin={kind!r}: {hint}")
        if mixed_precision is not None and mixed_precision not in _PRECISIONS:
            raise ConfigError(f"strategy.mixed_precision={mixed_precision!r}: use 'fp16', 'bf16' or None")
        self.plugin_name, self.plugin_kwargs = PLUGINS[kind], kwargs
        self.mixed_precision = None if mixed_precision == "fp32" else mixed_precision
        self.booster: Any = None
        self._boosted: tuple[Any, Any] = (None, None)

    @property
    def sharded(self) -> bool:
        return self.plugin_name in _SHARDED

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        device = dist.default_device()
        if device.type != "cuda" and self.sharded:  # refused before anything is started
            raise ConfigError(f"ColossalAIStrategy plugin {self.plugin_name} needs a CUDA device (colossalai 0.5 "
                              f"asserts one); on {device.type} use plugin='ddp'")
        import_colossalai()
        super().setup_env(dist.launcher_with_group(launcher), env_cfg)
        register_hybrid_adam()

    def _plugin(self) -> Any:
        from colossalai import booster

        kwargs = dict(self.plugin_kwargs)
        if self.sharded and self.mixed_precision:
            kwargs.setdefault("precision", self.mixed_precision)
        return getattr(booster.plugin, self.plugin_name)(**kwargs)

    # -- building ----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optim_wrapper: Any = None,
                transforms: Callable[[nn.Module], None] | None = None,
                optimizer_in_backward: bool = False) -> tuple[nn.Module, Any]:
        """Apply memory ``transforms``, build the optimizer from the config, boost both."""
        from colossalai.booster import Booster

        from memfit.optim.builder import build_optim_wrapper

        if optimizer_in_backward:
            raise ConfigError("cfg.optimizer_in_backward does not combine with ColossalAIStrategy: remove it")
        model = self.to_device(model)
        if transforms is not None:
            transforms(model)
        wrapper = None
        if optim_wrapper is not None:
            cfg = self._wrapper_cfg(optim_wrapper)
            wrapper = build_optim_wrapper(model, cfg)
        self.booster = Booster(plugin=self._plugin())
        boosted, boosted_opt, *_ = self.booster.boost(model, wrapper.optimizer if wrapper is not None else None)
        self._boosted = (boosted, boosted_opt)  # what the booster's checkpoint I/O saves and loads
        if wrapper is not None:
            wrapper.bind(self, self.device)
            wrapper.boosted = boosted_opt
        return StepThroughWrapper(boosted, model), wrapper

    def _wrapper_cfg(self, cfg: Any) -> dict:
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"optim_wrapper must be a config dict under ColossalAIStrategy, got {type(cfg).__name__}")
        cfg = dict(cfg)
        kind = cfg.pop("type", "OptimWrapper")
        kind = getattr(kind, "__name__", kind)
        if kind not in ("OptimWrapper", "AmpOptimWrapper", "ColossalAIOptimWrapper"):
            raise ConfigError(f"optim_wrapper.type={kind!r} under ColossalAIStrategy: use OptimWrapper or "
                              "AmpOptimWrapper")
        if kind == "AmpOptimWrapper" and self.sharded:
            raise ConfigError("AmpOptimWrapper under a sharded colossalai plugin: the plugin owns precision; set "
                              "strategy mixed_precision='fp16'|'bf16' and use OptimWrapper")
        if kind == "AmpOptimWrapper" or (self.mixed_precision and not self.sharded):
            cfg.setdefault("dtype", {"fp16": "float16", "bf16": "bfloat16"}.get(self.mixed_precision))
            return {"type": ColossalAIAmpOptimWrapper, **cfg}
        return {"type": ColossalAIOptimWrapper, **cfg}

    # -- the step ----------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def grad_sync_context(self, model: nn.Module, sync: bool) -> Any:
        boosted = self._boosted[0]
        if sync or boosted is None or not self.booster.plugin.support_no_sync():
            return contextlib.nullcontext()
        return self.booster.no_sync(boosted)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, **kw: Any):
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, **kw)

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> Any:
        return self.unwrap(model).state_dict() if not self.sharded else _Booster("model")

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        if not self.sharded:
            return wrapper.state_dict()
        return {**{k: v for k, v in wrapper.state_dict().items() if k != "optimizer"}, "optimizer": _Booster("opt")}

    def save_checkpoint(self, path: str | Path, state: dict) -> None:
        """DDP plugin: memfit's single file. Sharded plugins: the booster's sharded model and optimizer
        files plus memfit's extras in a directory renamed into place (every rank must call this)."""
        if not self.sharded:
            return super().save_checkpoint(path, state)
        from memfit.checkpoint import save_checkpoint as save_state_file

        path = Path(path)
        tmp = path.parent / dist.broadcast_object(f".{path.name}.tmp-{os.getpid()}")
        model, optimizer = self._boosted
        self.booster.save_model(model, str(tmp / "model"), shard=True)
        self.booster.save_optimizer(optimizer, str(tmp / "optimizer"), shard=True)
        extras = {k: v for k, v in state.items() if k not in ("state_dict", "grads")}
        extras["optim_wrapper"] = {k: v for k, v in extras.get("optim_wrapper", {}).items() if k != "optimizer"}
        dist.barrier()
        if dist.is_main_process():
            save_state_file(extras, tmp / "memfit_state.pth")
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.replace(tmp, path)
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> dict:
        path = Path(path)
        if not (self.sharded and path.is_dir()):
            return super().load_checkpoint(path)
        from memfit.checkpoint import load_checkpoint as load_state_file

        state = load_state_file(path / "memfit_state.pth")
        state["state_dict"] = _Booster("model", path / "model")
        if "optim_wrapper" in state:
            state["optim_wrapper"]["optimizer"] = _Booster("opt", path / "optimizer")
        return state

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        if isinstance(state, _Booster):
            return self.booster.load_model(self._boosted[0], str(state.path), strict=strict)
        return super().load_model_state_dict(model, state, strict)

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        osd = state.get("optimizer")
        if isinstance(osd, _Booster):
            self.booster.load_optimizer(wrapper.boosted, str(osd.path))
            wrapper.inner_count = state.get("inner_count", wrapper.inner_count)
            return
        super().load_optim_state_dict(model, wrapper, state)


class _Booster:
    """Stands for state the booster writes and reads itself."""

    def __init__(self, what: str, path: Path | None = None) -> None:
        self.what, self.path = what, path


class _BoostedSteps:
    """Backward and step through the boosted optimizer (it unscales, reduces and shards as its plugin
    needs); ``optimizer`` stays the torch optimizer, whose param_groups the LR schedulers change."""

    boosted: Any = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.boosted is None:
            return super().backward(loss, **kwargs)
        if getattr(self, "scaler", None) is not None:
            loss = self.scaler.scale(loss)
        self.boosted.backward(loss, **kwargs)

    def _step_optimizer(self) -> Any:
        return self.boosted if self.boosted is not None else self.optimizer


class ColossalAIOptimWrapper(_BoostedSteps, OptimWrapper):
    """OptimWrapper whose step goes through colossalai's boosted optimizer."""

    def step(self, **kwargs: Any) -> None:
        if self.clip_grad:
            self.grad_norm = self._clip_grads()
        self._step_optimizer().step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        self._step_optimizer().zero_grad(**kwargs)


class ColossalAIAmpOptimWrapper(_BoostedSteps, AmpOptimWrapper):
    """AmpOptimWrapper (torch autocast, GradScaler for fp16) for the DDP plugin."""

    def zero_grad(self, **kwargs: Any) -> None:
        self._step_optimizer().zero_grad(**kwargs)
