"""Strategies: one interface (base.Strategy), one backend per module."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities
from memfit.strategies.colossalai import ColossalAIStrategy
from memfit.strategies.ddp import DDPStrategy
from memfit.strategies.deepspeed import DeepSpeedStrategy
from memfit.strategies.fsdp import FSDPStrategy
from memfit.strategies.single import SingleDeviceStrategy

_DS_OFFLOAD = dict(offload_optimizer=dict(device="cpu"), offload_param=dict(device="cpu"))

# Lightning-style short names -> strategy configs (documented in docs/distributed.md).
SHORT_NAMES: dict[str, dict[str, Any]] = {
    "single": dict(type="SingleDeviceStrategy"),
    "single_device": dict(type="SingleDeviceStrategy"),
    "ddp": dict(type="DDPStrategy"),
    "ddp_find_unused_parameters_true": dict(type="DDPStrategy", find_unused_parameters=True),
    "ddp_zero": dict(type="DDPStrategy", zero=True),
    "zero": dict(type="DDPStrategy", zero=True),  # VISSL's OPTIMIZER.name: zero
    "fsdp": dict(type="FSDPStrategy"),
    "fsdp_offload": dict(type="FSDPStrategy", cpu_offload=True),
    "fsdp_shard_grad_op": dict(type="FSDPStrategy", reshard_after_forward=False),
    "deepspeed": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=2)),
    "deepspeed_stage_1": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=1)),
    "deepspeed_stage_2": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=2)),
    "deepspeed_stage_2_offload": dict(type="DeepSpeedStrategy",
                                      zero_optimization=dict(stage=2, offload_optimizer=dict(device="cpu"))),
    "deepspeed_stage_3": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=3)),
    "deepspeed_stage_3_offload": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=3, **_DS_OFFLOAD)),
}

# MMEngine's ``model_wrapper_cfg`` types -> the strategy that does the same.
_MODEL_WRAPPERS = {
    "MMFullyShardedDataParallel": "FSDPStrategy",
    "FullyShardedDataParallel": "FSDPStrategy",
    "MMDistributedDataParallel": "DDPStrategy",
    "DistributedDataParallel": "DDPStrategy",
    "MMSeparateDistributedDataParallel": "DDPStrategy",
}


def strategy_from_model_wrapper(cfg: Any) -> Strategy:
    """The strategy for MMEngine's ``cfg=dict(model_wrapper_cfg=dict(type=..., ...))``.

    ``MMFullyShardedDataParallel`` (with FSDP1 arguments such as ``cpu_offload=True`` or
    ``auto_wrap_policy``) becomes :class:`FSDPStrategy`; ``MMDistributedDataParallel`` (with DDP
    arguments) becomes :class:`DDPStrategy`; ``MMSeparateDistributedDataParallel`` one DDP per submodule
    (``DDPStrategy(separate=True)``, with MMEngine's default ``broadcast_buffers=False``).
    """
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ConfigError(f"cfg.model_wrapper_cfg={cfg!r}: use dict(type='MMFullyShardedDataParallel', ...) "
                          "or dict(type='MMDistributedDataParallel', ...)")
    kind = cfg["type"] if isinstance(cfg["type"], str) else getattr(cfg["type"], "__name__", str(cfg["type"]))
    if kind not in _MODEL_WRAPPERS:
        from memfit.errors import did_you_mean

        raise ConfigError(f"cfg.model_wrapper_cfg.type={kind!r}: {did_you_mean(kind, list(_MODEL_WRAPPERS))}")
    args = {k: v for k, v in cfg.items() if k != "type"}
    if _MODEL_WRAPPERS[kind] == "FSDPStrategy":
        return FSDPStrategy(model_wrapper=args)
    if kind == "MMSeparateDistributedDataParallel":
        return DDPStrategy(**{"broadcast_buffers": False, **args, "separate": True})
    return DDPStrategy(**args)


def build_strategy(cfg: Any, world_size: int = 1) -> Strategy:
    """A Strategy from an object, a dict with ``type`` or a short name such as 'ddp'. None: one device, or
    data parallel (DDP) when ``world_size`` processes were launched, as MMEngine does."""
    if cfg is None:
        return DDPStrategy() if world_size > 1 else SingleDeviceStrategy()
    if isinstance(cfg, Strategy):
        return cfg
    if isinstance(cfg, str):
        if cfg in SHORT_NAMES:
            cfg = SHORT_NAMES[cfg]
        elif cfg in STRATEGIES:
            cfg = dict(type=cfg)
        else:
            from memfit.errors import did_you_mean

            raise ConfigError(f"unknown strategy {cfg!r}: {did_you_mean(cfg, list(SHORT_NAMES) + STRATEGIES.names())}")
    return STRATEGIES.build(cfg, key="strategy")


def capabilities_of(cfg: Any, world_size: int = 1) -> Capabilities:
    """What the strategy a config names does (built, never set up: no process group, no device)."""
    import copy

    return build_strategy(copy.deepcopy(cfg), world_size).capabilities


def sharding_config(sharding: str, offload_parameters: bool, current: Any = None) -> Any:
    """The strategy config that runs the planner's ``sharding`` ('none', 'zero1', 'zero2', 'fsdp';
    :attr:`Capabilities.sharding`), with the parameters on the host if ``offload_parameters``; the ``current``
    config's own FSDP options (units, mixed precision, ...) are kept. None: the runner's default (one device,
    or DDP when launched as several processes)."""
    if sharding in ("zero2", "fsdp") or offload_parameters:
        own = dict(current) if isinstance(current, dict) and current.get("type") == "FSDPStrategy" else {}
        own.pop("reshard_after_forward", None)
        own.pop("cpu_offload", None)
        return {**own, "type": "FSDPStrategy", "reshard_after_forward": sharding != "zero2",
                "cpu_offload": offload_parameters}
    if sharding == "zero1":
        return dict(type="DDPStrategy", zero=True)
    return None


def fake_step_strategy(cfg: Any, world_size: int = 1) -> Any:
    """The strategy config the planner's fake step runs for ``cfg``: ``cfg`` itself where the strategy runs on
    fake tensors, else the FSDP2 / ZeRO-1 config of the sharding it declares (DeepSpeed's and colossalai's
    engines do not run there)."""
    caps = capabilities_of(cfg, world_size)
    return cfg if caps.fake_step else sharding_config(caps.sharding, caps.offloads_parameters)


def fake_step_config(cfg: Any) -> Any:
    """The strategy config whose fake step is ``cfg``'s, written one way (:meth:`Strategy.fake_step_options`)."""
    kind = cfg.get("type") if isinstance(cfg, dict) else None
    if not isinstance(kind, str) or kind not in STRATEGIES:
        return cfg
    return STRATEGIES.get(kind).fake_step_options(cfg)


__all__ = ["Capabilities", "ColossalAIStrategy", "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "SHORT_NAMES",
           "SingleDeviceStrategy", "Strategy", "build_strategy", "capabilities_of", "fake_step_config",
           "fake_step_strategy", "sharding_config", "strategy_from_model_wrapper"]
