"""ColossalAIStrategy: train through colossalai's Booster with its Gemini, LowLevelZero or DDP plugin.

The config, as in MMEngine's large-model training guide, is
``strategy=dict(type='ColossalAIStrategy', plugin='gemini'|'lowlevel-zero'|'ddp', mixed_precision='fp16'|'bf16')``
with ``optim_wrapper=dict(optimizer=dict(type='HybridAdam', lr=...))``. What runs where (colossalai 0.5.0
under torch 2.14; see docs/colossalai.md): on CPU only the DDP plugin works as shipped. LowLevelZero
asserts a CUDA/NPU device, Gemini and HybridAdam need CUDA (HybridAdam's CPU kernel does not build
against torch 2.14's headers), so those combinations are refused on CPU with a one-line error instead of
failing deep inside colossalai.

memfit joins the process group itself (colossalai's ``launch_from_torch`` no longer takes the
``config=`` that MMEngine's strategy passes). The DDP plugin's model and optimizer hold full state on
every rank, so its checkpoints are memfit's own single file; Gemini/LowLevelZero shard the optimizer
and write through the booster's sharded checkpoint I/O as a directory checkpoint
(:mod:`memfit.checkpoint.directory`: atomic, the previous checkpoint readable after a crash).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.checkpoint.directory import StateRef, read_extras, save_directory, split_state
from memfit.errors import ConfigError
from memfit.precision import AutocastPrecision, HalfPrecision, Precision, parse_dtype
from memfit.registry import OPTIMIZERS, STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities, shards_up_to
from memfit.strategies.route import route_forward

logger = logging.getLogger("memfit")

# MMEngine's plugin names (and colossalai's class names) -> colossalai plugin class names.
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

    @property
    def capabilities(self) -> Capabilities:
        """Gemini shards everything (ZeRO-3), LowLevelZero its ``stage`` (1 or 2), the DDP plugin nothing; the
        booster owns the optimizer and the forward; Gemini and LowLevelZero keep parameters in flat chunks."""
        stage = {"GeminiPlugin": 3, "LowLevelZeroPlugin": int(self.plugin_kwargs.get("stage", 1))}
        return Capabilities(shards=shards_up_to(stage.get(self.plugin_name, 0)), data_parallel=True,
                            own_optimizer=True, own_offload="its GeminiPlugin's placement_policy / offload_optim_frac",
                            contiguous_parameters=True, fake_step=False,
                            optim_wrappers=frozenset({"ColossalAIOptimWrapper"}),
                            config_hint="strategy=dict(type='ColossalAIStrategy', ...)",
                            sharded_checkpoints=self.sharded, partial_gradients=False)

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
        if self.sharded and isinstance(self.precision, HalfPrecision):
            kwargs.setdefault("precision", "fp16" if self.precision.dtype is torch.float16 else "bf16")
        return getattr(booster.plugin, self.plugin_name)(**kwargs)

    # -- precision ---------------------------------------------------------------------------
    def precision_request(self) -> Precision | None:
        """``mixed_precision``: the sharded plugins' own ``precision`` (fp32 master weights kept by the
        plugin, a :class:`HalfPrecision`); torch autocast for the DDP plugin."""
        if self.mixed_precision is None:
            return None
        dtype = parse_dtype(self.mixed_precision, "strategy.mixed_precision")
        return HalfPrecision(dtype) if self.sharded else AutocastPrecision(dtype)

    def check_precision(self, precision: Precision) -> None:
        self.refuse_master_weights(precision, "strategy mixed_precision='bf16'|'fp16' (the plugin's fp32 masters) "
                                              "or precision=dict(opt_level='O1') (autocast)")
        if self.sharded and isinstance(precision, AutocastPrecision):
            raise ConfigError("AmpOptimWrapper under a sharded colossalai plugin: the plugin owns precision; set "
                              "strategy mixed_precision='fp16'|'bf16' and use OptimWrapper")
        if not self.sharded:
            super().check_precision(precision)

    # -- building ----------------------------------------------------------------------------
    def setup(self, model: nn.Module, optim_wrapper: Any) -> None:
        """Boost the model and the wrapper's torch optimizer; the model's forward then runs through
        the boosted model. ``optim_wrapper.optimizer`` stays the torch optimizer (its param_groups
        are what the LR schedulers change); backward and step go through the boosted one."""
        from colossalai.booster import Booster

        self.booster = Booster(plugin=self._plugin())
        optimizer = optim_wrapper.optimizer if optim_wrapper is not None else None
        boosted, boosted_opt, *_ = self.booster.boost(model, optimizer)
        self._boosted = (boosted, boosted_opt)  # what the booster's checkpoint I/O saves and loads
        route_forward(model, boosted)

    # -- the step ----------------------------------------------------------------------------
    def no_sync(self, model: nn.Module, sync: bool) -> Any:
        boosted = self._boosted[0]
        if sync or boosted is None or not self.booster.plugin.support_no_sync():
            return contextlib.nullcontext()
        return self.booster.no_sync(boosted)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Through the boosted optimizer: it unscales, reduces and shards as its plugin needs."""
        self._boosted[1].backward(self.precision.scale_loss(loss), **kwargs)

    def optimizer_step(self, optimizer: Any, clip_grad: dict | None = None, **kwargs: Any) -> torch.Tensor | None:
        if not self.sharded:  # the DDP plugin's boosted optimizer is the torch one behind a thin wrapper
            return super().optimizer_step(optimizer, clip_grad, **kwargs)
        norm = self.clip(optimizer, clip_grad)
        self._boosted[1].step(**kwargs)
        return norm

    def zero_grad(self, optimizer: Any, **kwargs: Any) -> None:
        self._boosted[1].zero_grad(**kwargs)

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> Any:
        return model.state_dict() if not self.sharded else StateRef(None, "model")

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        if not self.sharded:
            return wrapper.checkpoint_state()
        return {**wrapper.checkpoint_state(with_optimizer=False), "optimizer": StateRef(None, "optimizer")}

    def save_checkpoint(self, path: str | Path, state: dict) -> None:
        """DDP plugin: memfit's single file. Sharded plugins: the booster's sharded model and optimizer
        files as one directory checkpoint (:mod:`memfit.checkpoint.directory`); every rank calls this."""
        if not self.sharded:
            return super().save_checkpoint(path, state)
        model, optimizer = self._boosted

        def write(tmp: Path) -> None:
            self.booster.save_model(model, str(tmp / "model"), shard=True)
            self.booster.save_optimizer(optimizer, str(tmp / "optimizer"), shard=True)

        save_directory(path, split_state(state)[1], write)

    def load_checkpoint(self, path: str | Path) -> dict:
        path = Path(path)
        if not (self.sharded and path.is_dir()):
            return super().load_checkpoint(path)
        state = read_extras(path)
        state["state_dict"] = StateRef(path / "model", "model")
        if "optim_wrapper" in state:
            state["optim_wrapper"]["optimizer"] = StateRef(path / "optimizer", "optimizer")
        return state

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        if isinstance(state, StateRef):
            return self.booster.load_model(self._boosted[0], str(state.path), strict=strict)
        return super().load_model_state_dict(model, state, strict)

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        osd = state.get("optimizer")
        if isinstance(osd, StateRef):
            self.booster.load_optimizer(self._boosted[1], str(osd.path))
            wrapper.load_checkpoint_state({k: v for k, v in state.items() if k != "optimizer"})
            return
        super().load_optim_state_dict(model, wrapper, state)
