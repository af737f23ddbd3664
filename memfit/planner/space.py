"""The plan space: one :class:`Plan` per combination of precision, activation checkpointing, sharding,
offload, Conv-BN folding and micro-batch, with the speed levers it trains with (:mod:`memfit.planner.levers`),
read from a config and written back into one.

A plan names each axis with a short word; :meth:`Plan.apply` turns it into the config keys memfit
already runs (``optim_wrapper.type/dtype``, ``activation_checkpointing``, ``strategy``,
``efficient_conv_bn_eval``, ``train_dataloader.batch_size``, ``optim_wrapper.accumulative_counts``; the levers'
``compile``, ``channels_last``, ``optim_wrapper.optimizer.fused``, ``tf32``, ``env_cfg.cudnn_benchmark``),
so a plan the planner recommends is a config the runner trains. What the model offers (its repeated
blocks, their stages, BatchNorm that is frozen) decides which checkpointing and Conv-BN choices exist.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.model.blocks import find_blocks as _blocks
from memfit.optim.spec import OptimWrapperSpec
from memfit.strategies import build_strategy, sharding_config

PRECISIONS = ("fp32", "bf16", "fp16")
SHARDINGS = ("none", "zero1", "zero2", "fsdp")
OFFLOADS = ("none", "params", "optimizer")
_AC_ORDER = ("none", "stages", "every2", "selective", "blocks")  # roughly: least recompute first
# A compiled plan's ``compile`` when the config gives none: the whole model in one graph. Measured on an H100
# (docs/speed.md), regional compile's host time per block made it slower than whole-model compile (ResNet-50:
# slower than eager).
COMPILED_PLAN = {"regional": False}
# The speed levers: a plan's field -> its word in the plan's name (in this order, before mbBxK).
LEVER_WORDS = {"compile": "compile", "channels_last": "channels_last", "fused_optimizer": "fused", "tf32": "tf32",
               "cudnn_benchmark": "cudnn_benchmark"}


@dataclass(frozen=True)
class ModelFacts:
    """What the plan space needs to know about a model: its repeated blocks (FSDP's units and the
    checkpointing granularity), the stages holding them, whether any BatchNorm is frozen, and whether it
    has 2-D convolutions beyond a patch embedding (channels_last and cuDNN's benchmark speed those up; a
    ViT's one patchifying convolution, stride equal to its kernel, is a matmul in all but name)."""

    block_types: tuple[str, ...]
    blocks: tuple[str, ...]
    stages: tuple[str, ...]
    frozen_bn: bool
    convs: bool = False

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        model.train()  # norm_eval models put their BatchNorm back in eval mode here
        blocks = _blocks(model)
        types = tuple(sorted({type(m).__name__ for m in blocks.values()}))
        parents: dict[str, int] = {}
        for n in blocks:
            parent = n.rpartition(".")[0]
            parents[parent] = parents.get(parent, 0) + 1
        stages = tuple(p for p, c in parents.items() if p and c > 1)
        frozen = any(_is_frozen_bn(m) for m in model.modules())
        convs = any(isinstance(m, nn.Conv2d) and not _patchifies(m) for m in model.modules())
        return cls(types, tuple(blocks), stages if len(stages) > 1 else (), frozen, convs)


def _patchifies(conv: nn.Conv2d) -> bool:
    return tuple(conv.kernel_size) == tuple(conv.stride) and max(conv.kernel_size) > 1


def _is_frozen_bn(m: nn.Module) -> bool:
    bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
    return type(m).__name__ == "FrozenBatchNorm2d" or (bn and not m.training)


def ac_spec(choice: str, facts: ModelFacts) -> Any:
    """The ``activation_checkpointing`` value of a checkpointing choice (None for 'none')."""
    if choice == "none":
        return None
    if choice == "stages":
        return list(facts.stages)
    if choice.startswith("first"):  # 'first12': the planner's subset, the first N blocks
        return list(facts.blocks[: int(choice[5:])])
    spec: dict[str, Any] = {"types": list(facts.block_types)}
    if choice == "every2":
        spec["every_n"] = 2
    elif choice == "selective":
        spec["selective"] = True
    elif choice != "blocks":
        raise ConfigError(f"unknown activation checkpointing choice {choice!r}: "
                          f"use one of {', '.join(_AC_ORDER)} or firstN")
    return spec


def checkpointed_modules(model: nn.Module, facts: ModelFacts, choice: str) -> tuple[str, ...]:
    """The qualified names of the modules a checkpointing choice wraps in ``model`` (a meta model; a copy is
    wrapped), as :func:`memfit.memory.checkpointing.apply_activation_checkpointing` chooses them."""
    from memfit.memory.checkpointing import apply_activation_checkpointing

    spec = ac_spec(choice, facts)
    if spec is None:
        return ()
    if choice.startswith("first"):  # the first N blocks: disjoint modules, wrapped as named
        return tuple(spec)
    return tuple(apply_activation_checkpointing(copy.deepcopy(model), spec))


@dataclass(frozen=True)
class Plan:
    """One point of the plan space. ``activation_checkpointing``: none | stages | blocks | every2 |
    selective | firstN (the first N blocks); ``sharding``: none (DDP) | zero1 | zero2 (FSDP keeping
    gathered parameters until backward, SHARD_GRAD_OP) | fsdp (ZeRO-3); ``offload``: none | params
    (FSDP's CPU offload of parameters, gradients and optimizer state) | optimizer (the optimizer's state
    and step on the host, ``cfg.optimizer_offload``); the speed levers (:data:`LEVER_WORDS`): ``compile``
    (torch.compile: :data:`COMPILED_PLAN` unless the config gives its options), ``channels_last``,
    ``fused_optimizer``, ``tf32`` (matmuls and convolutions), ``cudnn_benchmark``; ``configured``: the config's
    own plan, applied as it is."""

    precision: str = "fp32"
    activation_checkpointing: str = "none"
    sharding: str = "none"
    offload: str = "none"
    efficient_conv_bn_eval: bool = False
    micro_batch: int = 1
    accumulative_counts: int = 1
    compile: bool = False
    channels_last: bool = False
    fused_optimizer: bool = False
    tf32: bool = False
    cudnn_benchmark: bool = False
    configured: bool = field(default=False, compare=False)

    @property
    def name(self) -> str:
        parts = [self.precision]
        if self.activation_checkpointing != "none":
            parts.append(f"ac:{self.activation_checkpointing}")
        if self.sharding != "none":
            parts.append(self.sharding)
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        if self.efficient_conv_bn_eval:
            parts.append("conv-bn")
        parts += [word for key, word in LEVER_WORDS.items() if getattr(self, key)]
        parts.append(f"mb{self.micro_batch}x{self.accumulative_counts}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("configured")
        return out

    def apply(self, cfg: dict, facts: ModelFacts) -> dict:
        """A copy of ``cfg`` set up to train with this plan."""
        cfg = copy.deepcopy(cfg)
        if self.configured:  # as it is, with the autocast dtype the target resolves made explicit
            ow = cfg.get("optim_wrapper")
            if isinstance(ow, dict) and str(ow.get("type", "")).endswith("AmpOptimWrapper") and not ow.get("dtype"):
                ow.update(_precision_keys(self.precision))
            return cfg
        techniques = dict(cfg.pop("cfg", None) or {})
        for key in ("activation_checkpointing", "efficient_conv_bn_eval", "model_wrapper_cfg", "optimizer_offload",
                    "channels_last", "tf32"):
            techniques.pop(key, None)
            cfg.pop(key, None)
        spec = ac_spec(self.activation_checkpointing, facts)
        if spec is not None:
            techniques["activation_checkpointing"] = spec
        if self.efficient_conv_bn_eval:
            techniques["efficient_conv_bn_eval"] = [""]
        if self.offload == "optimizer":
            techniques["optimizer_offload"] = True
        for key in ("channels_last", "tf32"):
            if getattr(self, key):
                techniques[key] = True
        cfg["cfg"] = techniques
        self._apply_levers(cfg)
        cfg["strategy"] = sharding_config(self.sharding, self.offload == "params", cfg.get("strategy"))
        ow = dict(cfg.get("optim_wrapper") or {})
        for key in ("dtype", "loss_scale"):
            ow.pop(key, None)
        ow.update(_precision_keys(self.precision))
        ow["accumulative_counts"] = self.accumulative_counts
        cfg["optim_wrapper"] = ow
        loader = dict(cfg["train_dataloader"])
        loader["batch_size"] = self.micro_batch
        cfg["train_dataloader"] = loader
        return cfg

    def _apply_levers(self, cfg: dict) -> None:
        """The levers outside ``cfg=dict(...)``: top-level ``compile`` (the config's own compile options kept, else
        :data:`COMPILED_PLAN`), ``env_cfg.cudnn_benchmark`` (other env_cfg keys kept), the optimizer's ``fused``
        (``foreach`` removed)."""
        if not self.compile:
            cfg.pop("compile", None)
        elif not cfg.get("compile"):
            cfg["compile"] = dict(COMPILED_PLAN)
        env = {k: v for k, v in (cfg.get("env_cfg") or {}).items() if k != "cudnn_benchmark"}
        if self.cudnn_benchmark:
            env["cudnn_benchmark"] = True
        if env or "env_cfg" in cfg:
            cfg["env_cfg"] = env
        ow = cfg.get("optim_wrapper")
        if isinstance(ow, dict) and isinstance(ow.get("optimizer"), dict):
            opt = {k: v for k, v in ow["optimizer"].items() if k != "fused" and not (self.fused_optimizer
                                                                                   and k == "foreach")}
            if self.fused_optimizer:
                opt["fused"] = True
            cfg["optim_wrapper"] = {**ow, "optimizer": opt}


def _precision_keys(precision: str) -> dict[str, str]:
    if precision == "fp32":
        return {"type": "OptimWrapper"}
    return {"type": "AmpOptimWrapper", "dtype": "bfloat16" if precision == "bf16" else "float16"}


def technique_cfg(cfg: dict) -> dict:
    """The memory-technique switches of a config, merged as ``Runner.from_cfg`` merges them
    (``cfg=dict(...)`` and the top-level keys)."""
    from memfit.config.schema import TECHNIQUE_KEYS

    return {**(cfg.get("cfg") or {}),
            **{k: cfg[k] for k in TECHNIQUE_KEYS if k in cfg and k not in ("auto_fit", "planner")}}


def configured_plan(cfg: dict, facts: ModelFacts, cuda: bool = True) -> Plan:
    """The plan a config describes, marked ``configured`` (its own settings are kept when applied).
    An ``AmpOptimWrapper`` without a dtype is what the target resolves it to: fp16 on CUDA; on a CPU,
    bf16 where it is native, else fp32 (memfit.precision.default_amp_dtype)."""
    ow = cfg.get("optim_wrapper") or {}
    strategy = build_strategy(copy.deepcopy(cfg.get("strategy")))  # built, never set up
    precision = _precision_word(ow, strategy, "cuda" if cuda else "cpu", cfg.get("precision"))
    techniques = {**technique_cfg(cfg), **{k: cfg[k] for k in ("channels_last", "tf32") if k in cfg}}
    ac = techniques.get("activation_checkpointing")
    caps = strategy.capabilities
    sharding, offload = caps.sharding, "params" if caps.offloads_parameters else "none"
    if techniques.get("optimizer_offload"):
        offload = "optimizer"
    spec = OptimWrapperSpec.of(ow)
    env = cfg.get("env_cfg") if isinstance(cfg.get("env_cfg"), dict) else {}
    return Plan(precision=precision, activation_checkpointing=_ac_name(ac, facts), sharding=sharding, offload=offload,
                efficient_conv_bn_eval=bool(techniques.get("efficient_conv_bn_eval")),
                micro_batch=int(cfg["train_dataloader"]["batch_size"]),
                accumulative_counts=spec.accumulative_counts,
                compile=bool(cfg.get("compile")), channels_last=bool(techniques.get("channels_last")),
                fused_optimizer=spec.fused, tf32=techniques.get("tf32") is True,
                cudnn_benchmark=bool(env.get("cudnn_benchmark")), configured=True)


def _precision_word(optim_wrapper: Any, strategy: Any, device_type: str, precision_cfg: Any) -> str:
    """'fp32', 'bf16' or 'fp16': the compute dtype the run resolves to on the target
    (:func:`memfit.precision.resolve_precision`, asked quietly: no GradScaler warning off a GPU, no log line)."""
    import logging
    import warnings

    from memfit.precision import precision_options, resolve_precision

    log = logging.getLogger("memfit")
    level, log.disabled = log.disabled, True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = resolve_precision(optim_wrapper, strategy, device_type,
                                      precision_options(precision_cfg)).dtype
    finally:
        log.disabled = level
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _ac_name(spec: Any, facts: ModelFacts) -> str:
    if not spec:
        return "none"
    for choice in _AC_ORDER[1:]:
        if ac_spec(choice, facts) == spec:
            return choice
    return "custom"


def enumerate_plans(configured: Plan, facts: ModelFacts, world_size: int, precisions: tuple[str, ...] = PRECISIONS,
                    host_offload: bool = True) -> list[Plan]:
    """Every plan worth predicting for a model trained at ``world_size`` ranks, keeping the global
    batch of ``configured`` (micro-batch x accumulation), without speed levers (they cost no memory, so
    they are not an axis of their own: :meth:`memfit.planner.levers.Levers.on` gives them). Pruned: checkpointing
    choices the model cannot express (no stages), Conv-BN folding without frozen BatchNorm, sharding at one
    rank (FSDP there only as the carrier of CPU offload), parameter offload without FSDP, optimizer offload
    under ZeRO-1 (which builds its own optimizer) and where the target is the host (``host_offload``
    False: a CPU run holds both memories in one)."""
    per_rank = configured.micro_batch * configured.accumulative_counts
    micro = [b for b in _halvings(configured.micro_batch) if per_rank % b == 0]
    acs = [a for a in _AC_ORDER if a != "stages" or facts.stages]
    if not facts.block_types:
        acs = ["none"]
    conv_bn = (False, True) if facts.frozen_bn else (False,)
    shardings = [("none", "none"), ("fsdp", "params")] if world_size == 1 else \
        [(s, "none") for s in SHARDINGS] + [("fsdp", "params")]
    if host_offload:
        shardings += [(s, "optimizer") for s in SHARDINGS if s != "zero1" and (world_size > 1 or s == "none")]
    plans = [Plan(p, a, s, o, c, b, per_rank // b)
             for p in precisions for a in acs for s, o in shardings for c in conv_bn for b in micro]
    return plans


def _halvings(b: int) -> list[int]:
    out = [b]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out
