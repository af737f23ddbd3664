"""``memfit bench``: measure plans on this device, beside the planner's prediction of each.

Each plan gets a fresh model (seed 0) set up by the runner's own code (:func:`memfit.connector.setup`),
warm-up optimizer steps until the optimizer state exists, as in every later step (fp16's loss scaler
skips the first steps of a model whose gradients overflow at its initial scale, DINO's), one step under
memfit's tracker (CPU: live tensor storage; CUDA: ``max_memory_allocated``, and ``memory_reserved``
beside it) and ``steps`` timed steps whose median is the step time. Times are reported as a ratio to
the first plan measured in the same run. Under torchrun every rank measures and rank 0 reports its own.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.measure import MemoryTracker, optimizer_state_tensors
from memfit.model.base import move_to
from memfit.planner.inputs import Inputs
from memfit.planner.space import ModelFacts, Plan, technique_cfg
from memfit.planner.step_profile import profiled_step

WARMUP_STEPS = 8  # GradScaler halves its scale at each skipped step: 2**16 -> 2**8 at most


@dataclass
class Measured:
    plan: Plan
    peak_bytes: int
    breakdown: dict[str, int]
    reserved: int
    seconds: float
    rel_step_time: float = 1.0
    times: tuple[float, ...] = ()  # every timed step's seconds
    host_times: tuple[float, ...] = ()  # each timed step's seconds until its Python returned, before the sync
    profile: dict[str, Any] = field(default_factory=dict)  # one more step profiled (measure_plan's ``profile``)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _process_switches() -> Iterator[None]:
    """cuDNN's benchmark and TF32 are switches of the whole process: a plan measures with its own, and the
    next plan starts from what was set before (torch's defaults, unless the caller chose)."""
    b = torch.backends
    saved = (b.cudnn.benchmark, b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision)
    try:
        yield
    finally:
        b.cudnn.benchmark, b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision = saved


def measure_plan(cfg: dict, plan: Plan, facts: ModelFacts, steps: int = 3, batch: Any = None,
                 profile: bool = False) -> Measured:
    """Peak bytes (tracker) and median optimizer-step seconds of ``plan`` applied to ``cfg``, on the
    device the strategy picks (this process's GPU, else the CPU), on ``batch`` (default: the largest batch
    the train pipeline can make, :mod:`memfit.planner.inputs`), with its speed levers on. ``profile``: one more
    step under ``torch.profiler``, host against device (:func:`memfit.planner.step_profile.profiled_step`)."""
    with _process_switches():
        return _measure_plan(cfg, plan, facts, steps, batch, profile)


def build_for_training(run_cfg: dict) -> tuple[nn.Module, Any, Any]:
    """``run_cfg``'s model (seed 0) and optimizer wrapper, set up as the runner sets them up, on the device its
    strategy picks (this process's GPU, else the CPU), in train mode; with the strategy."""
    from memfit import dist
    from memfit.connector import setup
    from memfit.optim.builder import scale_lr_cfg
    from memfit.precision import precision_options
    from memfit.registry import MODELS
    from memfit.strategies import build_strategy

    torch.manual_seed(0)
    strategy = build_strategy(run_cfg.get("strategy") or None, int(os.environ.get("WORLD_SIZE", "1")))  # as the runner
    env = run_cfg.get("env_cfg") or {}
    strategy.setup_env(dist.resolve_launcher(None), {"cudnn_benchmark": bool(env.get("cudnn_benchmark"))})
    model = MODELS.build(run_cfg["model"], key="model")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    optim_cfg = scale_lr_cfg(run_cfg["optim_wrapper"], run_cfg.get("auto_scale_lr"),
                             lambda: run_cfg["train_dataloader"]["batch_size"] * world)
    compiled = {"compile": run_cfg["compile"]} if run_cfg.get("compile") else {}  # as the runner compiles
    techniques = technique_cfg(run_cfg)
    model, wrapper = setup(model, strategy, optim_cfg, techniques, optimizer_offload=bool(techniques.get(
        "optimizer_offload")), precision=precision_options(run_cfg.get("precision")), **compiled)
    model.train()
    return model, wrapper, strategy


def _measure_plan(cfg: dict, plan: Plan, facts: ModelFacts, steps: int, batch: Any, profile: bool) -> Measured:
    run_cfg = plan.apply(cfg, facts)
    model, wrapper, strategy = build_for_training(run_cfg)
    batch = batch if batch is not None else Inputs(run_cfg).batch()
    k = plan.accumulative_counts
    device = strategy.device
    wrapper.initialize_count_status(model, 0, (steps + WARMUP_STEPS + 1 + profile) * k)

    def step() -> None:
        for _ in range(k):
            model.train_step(batch, optim_wrapper=wrapper)

    for _ in range(WARMUP_STEPS):  # until the optimizer state exists (fp16's scaler may skip steps)
        step()
        if getattr(wrapper, "scaler", None) is None or optimizer_state_tensors(wrapper.optimizer):
            break
    _sync(device)
    with MemoryTracker(model, wrapper.optimizer, device=device) as tracker:
        step()
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else tracker.peak_bytes
    # Timed as the Runner trains: its prefetcher has each batch on the device before the step. A batch copied from
    # pageable host memory inside the step waits for the kernels queued before it, once per micro-step.
    batch = move_to(batch, device)
    times, host = [], []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        _sync(device)
        times.append(time.perf_counter() - start)
    profiled = profiled_step(step, device) if profile else {}
    return Measured(plan, tracker.peak_bytes, dict(tracker.breakdown), reserved, statistics.median(times),
                    times=tuple(times), host_times=tuple(host), profile=profiled)


def bench(cfg: dict, plans: list[Plan], facts: ModelFacts, steps: int = 3, progress: bool = False,
          inputs: Inputs | None = None, profile: bool = False) -> list[Measured]:
    """Measure ``plans`` in order, on the batch the planner plans for (``inputs``); times relative to the first.
    ``profile``: each plan's one more step profiled (:func:`measure_plan`)."""
    inputs = inputs or Inputs(cfg)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(plans), desc="memfit bench", unit="plan", leave=False, file=sys.stderr)
    out = []
    try:
        # the process's first steps pay one-off start-up costs
        measure_plan(cfg, plans[0], facts, steps=1, batch=inputs.batch(plans[0].micro_batch))
        for plan in plans:
            if bar is not None:
                bar.set_postfix_str(plan.name)
            out.append(measure_plan(cfg, plan, facts, steps, batch=inputs.batch(plan.micro_batch), profile=profile))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    for m in out:
        m.rel_step_time = m.seconds / out[0].seconds
    return out
