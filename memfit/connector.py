"""The connector: turns the config's strategy, optimizer wrapper and precision settings into one
Strategy holding one Precision, and sets the model up in torchtitan's order (memory techniques,
speed levers, compile, then the strategy's wrapping).

Lightning Fabric's split: a strategy and a precision are separate objects; this small module
chooses them, maps MMEngine's names onto them (``AmpOptimWrapper`` asks for autocast,
``DeepSpeedOptimWrapper``/``ZeroOptimWrapper``/``ColossalAIOptimWrapper`` name a backend,
``model_wrapper_cfg`` a strategy) and rejects combinations that cannot work, in one line each.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit import dist
from memfit.errors import ConfigError
from memfit.precision import (
    AutocastPrecision,
    HalfPrecision,
    MasterWeightsPrecision,
    Precision,
    amp_precision,
    parse_dtype,
    precision_from_cfg,
)
from memfit.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

# MMEngine optimizer-wrapper names that stand for a backend: name -> the strategy class they need.
BACKEND_WRAPPERS = {
    "DeepSpeedOptimWrapper": "DeepSpeedStrategy",
    "ColossalAIOptimWrapper": "ColossalAIStrategy",
    "ZeroOptimWrapper": "DDPStrategy",  # ZeRO-1: DDPStrategy(zero=True)
}
_STRATEGY_HINTS = {"DeepSpeedStrategy": "strategy=dict(type='DeepSpeedStrategy', ...)",
                   "ColossalAIStrategy": "strategy=dict(type='ColossalAIStrategy', ...)",
                   "DDPStrategy": "strategy='ddp' (DDPStrategy)"}


def _type_name(kind: Any) -> str:
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def resolve_optim_wrapper(cfg: Any, strategy: Strategy) -> Any:
    """Map MMEngine's backend wrapper names onto a plain ``OptimWrapper`` config and the strategy they
    need (``ZeroOptimWrapper`` or ``optimizer=dict(type='ZeroRedundancyOptimizer', optimizer_type=...)``
    switch DDP's ZeRO-1 on). A live wrapper is returned as it is."""
    from memfit.optim.builder import is_multi_optim_cfg

    if not isinstance(cfg, dict):
        return cfg
    if is_multi_optim_cfg(cfg):
        for name, sub in cfg.items():
            kind = _type_name(sub.get("type", "OptimWrapper")) if isinstance(sub, dict) else type(sub).__name__
            if kind in BACKEND_WRAPPERS:
                raise ConfigError(f"optim_wrapper.{name}.type={kind!r}: a backend wrapper cannot be one of several "
                                  "optimizers; use OptimWrapper or AmpOptimWrapper for each")
        return cfg
    cfg = dict(cfg)
    kind = _type_name(cfg.get("type", "OptimWrapper"))
    optimizer = cfg.get("optimizer")
    if isinstance(optimizer, dict) and _type_name(optimizer.get("type")) == "ZeroRedundancyOptimizer":
        # MMEngine's form: the ZeRO optimizer is an optimizer type wrapping ``optimizer_type``.
        optimizer = dict(optimizer)
        optimizer.pop("type")
        if "optimizer_type" not in optimizer:
            raise ConfigError("optim_wrapper.optimizer.optimizer_type is missing: "
                              "dict(type='ZeroRedundancyOptimizer', optimizer_type='AdamW', lr=...)")
        cfg["optimizer"] = {"type": optimizer.pop("optimizer_type"), **optimizer}
        kind = "ZeroOptimWrapper" if kind == "OptimWrapper" else kind
    needed = BACKEND_WRAPPERS.get(kind)
    if needed is None:
        return cfg
    if type(strategy).__name__ != needed:
        extra = "; FSDPStrategy already shards the optimizer" if needed == "DDPStrategy" else ""
        raise ConfigError(f"optim_wrapper.type={kind!r} needs {_STRATEGY_HINTS[needed]}, not "
                          f"{type(strategy).__name__}: use OptimWrapper or AmpOptimWrapper with it{extra}")
    if isinstance(strategy, DDPStrategy):
        strategy.zero = True
    cfg["type"] = "OptimWrapper"
    return cfg


def _autocast_options(cfg: Any) -> dict | None:
    """dtype/loss_scale/fp32_modules when the wrapper is an AmpOptimWrapper (config or object), else None."""
    from memfit.optim.builder import is_multi_optim_cfg
    from memfit.optim.wrapper import AmpOptimWrapper
    from memfit.optim.wrapper_dict import OptimWrapperDict

    subs = cfg.optim_wrappers if isinstance(cfg, OptimWrapperDict) else cfg if is_multi_optim_cfg(cfg) else None
    if subs is not None:  # several optimizers share the run's one precision: they must agree
        options = {name: _autocast_options(sub) for name, sub in subs.items()}
        if len({repr(o) for o in options.values()}) > 1:
            raise ConfigError(f"optim_wrapper: the optimizers ask for different precisions ({options}): the model "
                              "runs in one; give every entry the same type (AmpOptimWrapper) and dtype")
        return next(iter(options.values()), None)
    if isinstance(cfg, AmpOptimWrapper):
        return dict(dtype=cfg.dtype, loss_scale=cfg.loss_scale, fp32_modules=cfg.fp32_modules)
    if isinstance(cfg, dict) and _type_name(cfg.get("type")) == "AmpOptimWrapper":
        return dict(dtype=parse_dtype(cfg.get("dtype"), "optim_wrapper.dtype"),
                    loss_scale=cfg.get("loss_scale", "dynamic"), fp32_modules=cfg.get("fp32_modules"))
    return None


def select_precision(optim_wrapper: Any, strategy: Strategy, precision_cfg: dict | None = None) -> Precision:
    """The run's one precision, from the Runner's ``precision=dict(opt_level=...)`` (Apex's levels), the
    optimizer wrapper (``AmpOptimWrapper``: autocast) or the strategy's own options (DeepSpeed's
    fp16/bf16/torch_autocast, FSDP's mixed_precision, colossalai's mixed_precision); given to the
    strategy, which refuses what its backend cannot run. Two of these at once are refused."""
    device_type = strategy.device.type
    amp = _autocast_options(optim_wrapper)
    requested = strategy.precision_request()
    where = type(strategy).__name__
    if precision_cfg is not None:
        precision = precision_from_cfg(precision_cfg, device_type)
        level = precision_cfg.get("opt_level")
        if amp is not None:
            raise ConfigError(f"precision=dict(opt_level={level!r}) and AmpOptimWrapper both set the precision: keep "
                              "one (opt_level='O1' is AmpOptimWrapper's autocast)")
        if requested is not None:
            raise ConfigError(f"precision=dict(opt_level={level!r}) and {where}'s own precision options "
                              f"({requested.name}) both set the precision: keep one")
    elif amp is None:
        precision = requested or Precision(device_type)
    else:
        if isinstance(requested, HalfPrecision):
            raise ConfigError(f"AmpOptimWrapper (torch autocast) and {where}'s whole-model {requested.name} "
                              "(parameters cast to half) are two precisions: keep one")
        dtype = amp["dtype"]
        if isinstance(requested, AutocastPrecision):
            if dtype is not None and dtype != requested.dtype:
                raise ConfigError(f"{where} asks for autocast in {requested.name[:4]} and optim_wrapper.dtype for "
                                  f"{str(dtype).removeprefix('torch.')}: they disagree, set one of them")
            dtype = requested.dtype
        precision = amp_precision(dtype, device_type, amp["loss_scale"], amp["fp32_modules"])
    strategy.set_precision(precision)
    return precision


def _check_in_backward(strategy: Strategy, optim_wrapper: Any, precision: Precision) -> None:
    from memfit.optim.in_backward import check_in_backward_compatible

    if isinstance(precision, MasterWeightsPrecision):
        raise ConfigError(f"cfg.optimizer_in_backward and precision opt_level={precision.opt_level!r}: the master "
                          "weights step after the whole backward; use one of them")
    if type(strategy) is not SingleDeviceStrategy or dist.get_world_size() > 1:
        raise ConfigError(f"cfg.optimizer_in_backward runs in one process on one device only "
                          f"({type(strategy).__name__}, world size {dist.get_world_size()}): gradients would be "
                          "stepped before they are reduced across ranks or by the backend's optimizer; remove it")
    counts = optim_wrapper.get("accumulative_counts", 1) if isinstance(optim_wrapper, dict) else 1
    clip = optim_wrapper.get("clip_grad") if isinstance(optim_wrapper, dict) else None
    check_in_backward_compatible(counts, clip, grad_scaler=getattr(precision, "scaler", None))


_OWN_OFFLOAD = {"DeepSpeedStrategy": "zero_optimization=dict(offload_optimizer=dict(device='cpu'))",
                "ColossalAIStrategy": "its GeminiPlugin's placement_policy / offload_optim_frac"}


def _check_offload(strategy: Strategy, precision: Precision, in_backward: bool) -> None:
    """Optimizer offload runs where memfit builds and steps the optimizer over the model's parameters."""
    name = type(strategy).__name__
    if name in _OWN_OFFLOAD:
        raise ConfigError(f"cfg.optimizer_offload is memfit's; {name} offloads its own optimizer: use "
                          f"{_OWN_OFFLOAD[name]} instead")
    if getattr(strategy, "zero", False):
        raise ConfigError("cfg.optimizer_offload and ZeRO-1 (DDPStrategy zero=True): ZeroRedundancyOptimizer builds "
                          "its own optimizer; use strategy=dict(type='FSDPStrategy', reshard_after_forward=False) "
                          "(ZeRO-2) with optimizer_offload, or drop zero")
    if getattr(strategy, "cpu_offload", False):
        raise ConfigError("cfg.optimizer_offload and FSDPStrategy cpu_offload=True: CPU offload already keeps the "
                          "optimizer (and the parameters) on the host; use one of them")
    if isinstance(precision, MasterWeightsPrecision):
        raise ConfigError(f"cfg.optimizer_offload and precision opt_level={precision.opt_level!r}: the fp32 master "
                          "weights would stay on the device; use optim_wrapper=dict(type='AmpOptimWrapper') instead")
    if in_backward:
        raise ConfigError("cfg.optimizer_offload and cfg.optimizer_in_backward: one steps on the host after backward, "
                          "the other on the device inside it; use one of them")


def _check_several_optimizers(optim_wrapper: Any, strategy: Strategy) -> None:
    """Before wrapping: several optimizers need one DDP per submodule under DDPStrategy (set here)."""
    from memfit.optim.builder import is_multi_optim_cfg
    from memfit.optim.wrapper_dict import OptimWrapperDict
    from memfit.strategies.ddp_separate import check_several_optimizers

    if isinstance(optim_wrapper, OptimWrapperDict) or is_multi_optim_cfg(optim_wrapper):
        check_several_optimizers(strategy, dist.get_world_size())


def _check_built_several_optimizers(wrapper: Any, strategy: Strategy) -> None:
    """After building: an OptimWrapperDict from a custom constructor came after the model was wrapped."""
    from memfit.optim.wrapper_dict import OptimWrapperDict
    from memfit.strategies.ddp_separate import check_several_optimizers

    if isinstance(wrapper, OptimWrapperDict):
        check_several_optimizers(strategy, dist.get_world_size())
        if isinstance(strategy, DDPStrategy) and strategy.ddp is not None:
            raise ConfigError("optim_wrapper.constructor built several optimizers after the model was wrapped in one "
                              "DDP: set strategy=dict(type='DDPStrategy', separate=True) (one DDP per submodule)")


def setup(model: nn.Module, strategy: Strategy, optim_wrapper: Any = None, techniques: dict | None = None, *,
          optimizer_in_backward: bool = False, optimizer_offload: bool = False,
          precision: dict | None = None, compile: bool | dict = False) -> tuple[nn.Module, Any]:
    """Set ``model`` up for training (``optim_wrapper`` given) or evaluation; returns (model, wrapper).

    The order is torchtitan's: choose the precision, move the model to the device, apply the memory
    techniques (``techniques``: the runner's ``cfg`` switches), make it channels_last (``techniques``'
    ``channels_last``), convert it for the precision (fp32 islands, whole-model casts), compile it
    (``compile``: the Runner's key, regional by default, :mod:`memfit.speed.compile`), let the strategy
    wrap or shard it, build the optimizer over the wrapped parameters, let the precision prepare it
    (fp32 master weights) and the strategy finish with it (ZeRO-1, DeepSpeed's engine, colossalai's
    booster). ``techniques``' ``tf32`` sets the process-wide TF32 flags first. ``optimizer_offload``: the
    optimizer's state and step on the host (:mod:`memfit.optim.offload`). ``precision``: the Runner's
    ``precision=dict(opt_level=...)`` (Apex's levels), None to follow the wrapper and the strategy.
    """
    from memfit.memory import apply_memory_techniques
    from memfit.optim.builder import build_optim_wrapper
    from memfit.speed import apply_channels_last, apply_compile, check_speed_levers

    if not strategy.env_ready:  # built by hand (tests, notebooks): join the launch's group, pick the device
        strategy.setup_env(dist.resolve_launcher(None))
    optim_wrapper = resolve_optim_wrapper(optim_wrapper, strategy)
    precision_policy = select_precision(optim_wrapper, strategy, precision)
    if optimizer_in_backward and optim_wrapper is not None:
        _check_in_backward(strategy, optim_wrapper, precision_policy)
    if optimizer_offload and optim_wrapper is not None:
        _check_offload(strategy, precision_policy, optimizer_in_backward)
    compile_options = check_speed_levers(techniques, compile, strategy.device)
    model = strategy.to_device(model)
    if techniques:
        apply_memory_techniques(model, techniques)
    if techniques and techniques.get("channels_last"):
        apply_channels_last(model, weights=not strategy.contiguous_parameters)
    precision_policy.convert_module(model)
    if compile_options is not None:
        apply_compile(model, compile_options)
    if optim_wrapper is not None:
        _check_several_optimizers(optim_wrapper, strategy)
    model = strategy.wrap(model)
    wrapper = None
    if optim_wrapper is not None:
        wrapper = build_optim_wrapper(model, optim_wrapper, in_backward=optimizer_in_backward,
                                      offload=optimizer_offload)
        _check_built_several_optimizers(wrapper, strategy)
        wrapper.strategy = strategy
        precision_policy.prepare_optimizer(wrapper)
    strategy.setup(model, wrapper)
    return model, wrapper
