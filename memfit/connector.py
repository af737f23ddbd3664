"""The connector: turns the config's strategy, optimizer wrapper and precision settings into one
Strategy holding one Precision, and sets the model up in torchtitan's order (memory techniques,
speed levers, compile, then the strategy's wrapping).

Lightning Fabric's split: a strategy and a precision are separate objects; this small module
chooses them, maps MMEngine's names onto them (``AmpOptimWrapper`` asks for autocast, decided by
:func:`memfit.precision.resolve_precision`; ``DeepSpeedOptimWrapper``/``ZeroOptimWrapper``/
``ColossalAIOptimWrapper`` name a backend, found through the strategies' declared capabilities) and
rejects combinations that cannot work, in one line each. It asks a strategy what it does
(:class:`memfit.strategies.Capabilities`), never its name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit import dist
from memfit.errors import ConfigError
from memfit.precision import MasterWeightsPrecision, Precision, resolve_precision
from memfit.registry import OPTIM_WRAPPERS, STRATEGIES
from memfit.strategies import Capabilities, Strategy


def backend_wrappers() -> dict[str, Capabilities]:
    """MMEngine optimizer-wrapper names that stand for a backend (``DeepSpeedOptimWrapper``), each with the
    capabilities of the registered strategy that declares it (``Capabilities.optim_wrappers``)."""
    out: dict[str, Capabilities] = {}
    for name in STRATEGIES.names():
        declared = getattr(STRATEGIES.get(name), "capabilities", None)
        if isinstance(declared, Capabilities):  # a class attribute; a property is read from an instance
            caps = declared
        else:
            try:
                caps = STRATEGIES.get(name)().capabilities
            except Exception:  # noqa: BLE001 - a strategy that needs arguments declares nothing here
                continue
        out.update({wrapper: caps for wrapper in caps.optim_wrappers})
    return out


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
        backends = backend_wrappers()
        for name, sub in cfg.items():
            kind = _type_name(sub.get("type", "OptimWrapper")) if isinstance(sub, dict) else type(sub).__name__
            if kind in backends:
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
    if kind in OPTIM_WRAPPERS:  # memfit's own wrapper (OptimWrapper, AmpOptimWrapper): no backend to look up
        return cfg
    needed = backend_wrappers().get(kind)
    if needed is None:
        return cfg
    if kind not in strategy.capabilities.optim_wrappers:
        extra = f"; {type(strategy).__name__} already shards the optimizer" \
            if "optimizer" in strategy.capabilities.shards else ""
        raise ConfigError(f"optim_wrapper.type={kind!r} needs {needed.config_hint}, not "
                          f"{type(strategy).__name__}: use OptimWrapper or AmpOptimWrapper with it{extra}")
    strategy.use_optim_wrapper(kind)
    cfg["type"] = "OptimWrapper"
    return cfg


def select_precision(optim_wrapper: Any, strategy: Strategy, precision_cfg: dict | None = None) -> Precision:
    """The run's one precision (:func:`memfit.precision.resolve_precision`), given to the strategy, which
    refuses what its backend cannot run."""
    precision = resolve_precision(optim_wrapper, strategy, strategy.device.type, precision_cfg)
    strategy.set_precision(precision)
    return precision


def _check_in_backward(strategy: Strategy, optim_wrapper: Any, precision: Precision) -> None:
    from memfit.optim.in_backward import check_in_backward_compatible
    from memfit.optim.spec import OptimWrapperSpec

    if isinstance(precision, MasterWeightsPrecision):
        raise ConfigError(f"cfg.optimizer_in_backward and precision opt_level={precision.opt_level!r}: the master "
                          "weights step after the whole backward; use one of them")
    if not strategy.capabilities.one_device or dist.get_world_size() > 1:
        raise ConfigError(f"cfg.optimizer_in_backward runs in one process on one device only "
                          f"({type(strategy).__name__}, world size {dist.get_world_size()}): gradients would be "
                          "stepped before they are reduced across ranks or by the backend's optimizer; remove it")
    spec = OptimWrapperSpec.of(optim_wrapper)
    check_in_backward_compatible(spec.accumulative_counts, spec.clip_grad,
                                 grad_scaler=getattr(precision, "scaler", None))


def _check_offload(strategy: Strategy, precision: Precision, in_backward: bool) -> None:
    """Optimizer offload runs where memfit builds and steps the optimizer over the model's parameters."""
    name, caps = type(strategy).__name__, strategy.capabilities
    if caps.own_offload:
        raise ConfigError(f"cfg.optimizer_offload is memfit's; {name} offloads its own optimizer: use "
                          f"{caps.own_offload} instead")
    if caps.own_optimizer:
        raise ConfigError(f"cfg.optimizer_offload and {name} ({caps.sharding}): the backend builds its own optimizer "
                          "(ZeRO-1's ZeroRedundancyOptimizer); use strategy=dict(type='FSDPStrategy', "
                          "reshard_after_forward=False) (ZeRO-2) with optimizer_offload, or drop zero")
    if caps.offloads_parameters:
        raise ConfigError(f"cfg.optimizer_offload and {name}'s parameter offload (cpu_offload=True): it already keeps "
                          "the optimizer (and the parameters) on the host; use one of them")
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
        if getattr(strategy, "ddp", None) is not None:
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
        apply_channels_last(model, weights=not strategy.capabilities.contiguous_parameters)
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
