"""The speed levers as plan axes: which of them a target device and a model allow, and what the planner's
fake step runs of a plan that has them.

The levers (``channels_last``, a ``fused`` optimizer, TF32, cuDNN's benchmark, ``torch.compile``)
change a step's time, not what it must hold: channels_last stores the same bytes in another order, TF32 and
the benchmark choose kernels, and a fused optimizer step holds less than torch's default ``foreach`` step (no
parameter-sized temporaries). So the plan space is not multiplied by them: every plan the planner enumerates
gets every lever its target and model allow (:meth:`Levers.on`), and the time model
(:mod:`memfit.planner.cost`) prices each. ``compile`` is the exception: the memory of the graphs torch.compile
makes (Inductor's fusions, its recomputing partitioner, its buffer reuse) is not what a fake eager step shows,
so compiled plans are listed only when asked for, each as the twin of an eager plan whose memory it reports.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch

from memfit.errors import ConfigError
from memfit.planner.devices import Device
from memfit.planner.space import LEVER_WORDS, ModelFacts, Plan

EAGER_MEMORY = "eager plan's"  # a compiled plan's memory source, in the --json document and the table
# cuDNN's benchmark tries algorithms with workspaces the allocator then keeps reserved, which the fake step
# cannot see: +0.20 GiB reserved for ResNet-50 160 px batch 128 bf16 on an H100 (3.89 against 3.69 GiB,
# benchmarks/gpu_throughput_h100.json) for a measured 1.012x. Plans get it only when the config asks for it.
BENCHMARK_OFF = "its workspaces' memory is not predicted: set env_cfg.cudnn_benchmark=True to plan with it"


@dataclass(frozen=True)
class Levers:
    """The levers a target and a model allow, and why each of the others is off (``off``: lever -> why).
    ``compile``: compiled twins of the plans are listed (asked for); ``fused_fsdp``: the fused step also runs
    on FSDP's sharded parameters."""

    channels_last: bool = False
    fused_optimizer: bool = False
    fused_fsdp: bool = False
    tf32: bool = False
    cudnn_benchmark: bool = False
    compile: bool = False
    off: tuple[tuple[str, str], ...] = ()

    def on(self, plan: Plan) -> Plan:
        """``plan`` with every allowed lever: TF32 only for fp32 plans (half precision has no fp32 matmuls),
        a fused optimizer only where the optimizer steps on the device (not offloaded to the host) and, under
        FSDP, only where DTensor has the fused kernel's sharding, channels_last not under FSDP
        (``fully_shard`` refuses non-contiguous parameters)."""
        fsdp = plan.sharding in ("zero2", "fsdp") or plan.offload == "params"
        fused = self.fused_optimizer and plan.offload == "none" and (self.fused_fsdp or not fsdp)
        return replace(plan, channels_last=self.channels_last and not fsdp, cudnn_benchmark=self.cudnn_benchmark,
                       fused_optimizer=fused, tf32=self.tf32 and plan.precision == "fp32")

    def describe(self) -> str:
        """One line for the plan table's footer: the levers the plans have, and why the others are off."""
        where = {"tf32": " (fp32 plans)", "channels_last": " (not under FSDP)",
                 "fused_optimizer": " (not offloaded)" if self.fused_fsdp else " (not offloaded, not under FSDP)"}
        on = [LEVER_WORDS[k] + where.get(k, "") for k in LEVER_WORDS if k != "compile" and getattr(self, k)]
        if self.compile:
            on.append(f"compile (twins of the plans; memory: the {EAGER_MEMORY})")
        off = [f"{LEVER_WORDS[k]} ({why})" for k, why in self.off]
        return f"speed levers: {', '.join(on) or 'none'}" + (f"; off: {', '.join(off)}" if off else "")


def _optimizer_class(cfg: dict) -> Any:
    from memfit.registry import OPTIMIZERS

    ow = cfg.get("optim_wrapper")
    opt = ow.get("optimizer") if isinstance(ow, dict) else None
    if not isinstance(opt, dict):
        return None
    try:
        return OPTIMIZERS.get(opt.get("type")) if isinstance(opt.get("type"), str) else opt.get("type")
    except (ConfigError, KeyError):
        return None


def takes_fused(cfg: dict) -> bool:
    """Whether the config's optimizer type takes torch's ``fused=`` argument (AdamW, Adam, SGD, Adagrad)."""
    try:
        return "fused" in inspect.signature(_optimizer_class(cfg)).parameters
    except (TypeError, ValueError):
        return False


def fused_on_shards(cfg: dict) -> bool:
    """Whether the config's fused optimizer steps FSDP2's DTensor parameters: DTensor has a sharding rule for
    the fused Adam and AdamW kernels only (torch/distributed/tensor/_ops/_pointwise_ops.py, torch 2.14); fused
    SGD or Adagrad over shards fails at the first step."""
    cls = _optimizer_class(cfg)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Adam)


def allowed_levers(cfg: dict, facts: ModelFacts, device: Device, fixed_size: bool, compile: bool = False) -> Levers:
    """The levers every enumerated plan of ``cfg`` gets on ``device``: TF32 where the device has it (Ampere
    and newer), channels_last where the model has 2-D convolutions beyond a patch embedding, a fused optimizer
    where its type takes ``fused``, cuDNN's benchmark for convolutions on one input size (``fixed_size``: each
    new size is tuned again) when the config already asks for it (:data:`BENCHMARK_OFF` says why not
    otherwise); all on CUDA only. ``compile``: list compiled twins."""
    env = cfg.get("env_cfg")
    benchmark = isinstance(env, dict) and bool(env.get("cudnn_benchmark"))
    why: dict[str, str] = {}
    if not compile:
        why["compile"] = "its memory is not predicted: ask with --compile"
    if not device.cuda:
        for key in ("channels_last", "fused_optimizer", "tf32", "cudnn_benchmark"):
            why[key] = "CUDA only"
        return Levers(compile=compile, off=tuple(why.items()))
    tf32 = device.dtype_tflops("tf32") is not None
    if not tf32:
        why["tf32"] = f"{device.name} has no TF32"
    if not facts.convs:
        why["channels_last"] = why["cudnn_benchmark"] = "no convolutions beyond a patch embedding"
    elif not fixed_size:
        why["cudnn_benchmark"] = "the input size varies (or was given): each new size would be tuned again"
    elif not benchmark:
        why["cudnn_benchmark"] = BENCHMARK_OFF
    fused = takes_fused(cfg)
    if not fused:
        why["fused_optimizer"] = "the optimizer takes no fused="
    return Levers(channels_last=facts.convs, fused_optimizer=fused, fused_fsdp=fused and fused_on_shards(cfg),
                  tf32=tf32, cudnn_benchmark=facts.convs and fixed_size and benchmark, compile=compile,
                  off=tuple((k, why[k]) for k in LEVER_WORDS if k in why))


def compiled_twins(plans: list[Plan]) -> list[Plan]:
    """A compiled twin of each eager plan (none of the configured one: it stays as the config says)."""
    return [replace(p, compile=True) for p in plans if not p.compile and not p.configured]


def fake_step_cfg(cfg: dict) -> dict:
    """``cfg`` as the planner's fake step runs it: without ``compile`` (its graphs' memory is not predicted:
    the eager step's is reported), ``tf32`` and ``env_cfg.cudnn_benchmark`` (global CUDA switches that change
    no tensor; the fake step runs on CPU tensors, where they have no device to switch). A shallow copy."""
    out = {k: v for k, v in cfg.items() if k not in ("compile", "tf32")}
    if isinstance(out.get("cfg"), dict):
        out["cfg"] = {k: v for k, v in out["cfg"].items() if k != "tf32"}
    if isinstance(out.get("env_cfg"), dict):
        out["env_cfg"] = {k: v for k, v in out["env_cfg"].items() if k != "cudnn_benchmark"}
    return out


def memory_source(plan: Plan) -> str:
    """Where a plan's memory comes from: its own fake step, or (compiled) its eager plan's."""
    return EAGER_MEMORY if plan.compile else "fake step"


__all__ = ["BENCHMARK_OFF", "EAGER_MEMORY", "Levers", "allowed_levers", "compiled_twins", "fake_step_cfg",
           "fused_on_shards", "memory_source", "takes_fused"]
