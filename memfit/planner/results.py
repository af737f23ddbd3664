"""A plan's predicted figures (:class:`PlanResult`), a whole prediction (:class:`Prediction`, its ``--json``
document), and how a step's tracked bytes become a plan's figures on its target device: the phases that
count, offload taken out, the simulated CUDA allocator's rounding and slack, the CUDA context and NCCL."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memfit.planner import devices
from memfit.planner.cost import ModelState, StepTime, step_time
from memfit.planner.devices import Device
from memfit.planner.fake import StepMeasurement
from memfit.planner.inputs import PlannedInput
from memfit.planner.levers import Levers, memory_source
from memfit.planner.space import Plan


@dataclass
class PlanResult:
    """A plan's prediction. ``peak_bytes``: what must fit on one rank's device (CUDA: reserved +
    CUDA context + NCCL buffers; CPU: live tensor bytes); ``allocated``/``reserved``: the caching
    allocator's figures (equal to the peak on CPU); ``source``: 'measured' (a whole fake step of this
    plan) or 'composed' (see :mod:`memfit.planner.predict`); a compiled plan's memory figures are its eager
    plan's (:func:`memfit.planner.levers.memory_source`)."""

    plan: Plan
    peak_bytes: int
    breakdown: dict[str, int]
    allocated: int
    reserved: int
    seconds: float
    source: str = "composed"
    rel_step_time: float = 1.0
    fits: bool = True
    time: StepTime | None = None  # ``seconds`` by part (what paces the step)


@dataclass
class Prediction:
    device: Device
    world_size: int
    budget: int
    results: list[PlanResult]
    recommended: int | None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    fake_steps: int = 0  # distinct fake steps run
    input: PlannedInput | None = None  # the configured micro-batch's input, as planned
    levers: Levers | None = None  # the speed levers the plans were given

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (exactly these keys; ``recommended`` indexes ``plans``; each plan's
        ``memory``: 'fake step', or "eager plan's" for a compiled plan; ``paced_by``: ``StepTime.bound``)."""
        return {
            "device": self.device.name,
            "world_size": self.world_size,
            "budget_bytes": self.budget,
            "input": self.input.as_dict() if self.input else None,
            "plans": [{"name": r.plan.name, **r.plan.as_dict(), "peak_bytes": r.peak_bytes,
                       "breakdown": r.breakdown, "rel_step_time": round(r.rel_step_time, 4), "fits": r.fits,
                       "memory": memory_source(r.plan), "paced_by": r.time.bound if r.time else None}
                      for r in self.results],
            "recommended": self.recommended,
        }


def allocator_rounding(run: StepMeasurement) -> int:
    """What ``run``'s simulated allocator held at its peak beyond the bytes requested: its blocks' rounding. A
    composed two-step replay counts what it requested itself (the optimizer state, the workspaces); otherwise
    the run's tracked peak and the workspaces were requested."""
    return run.cuda_allocated - (run.cuda_requested or run.peak + devices.CUBLAS_WORKSPACE)


def device_figures(tracked: int, breakdown: dict[str, int], device: Device, world_size: int,
                   run: StepMeasurement) -> tuple[int, dict[str, int], int, int]:
    """(peak that must fit, breakdown, allocated, reserved) on ``device`` for a tracked CPU peak. On CUDA,
    ``run``'s simulated caching allocator says what it held beyond ``run``'s own tracked peak: the cuBLAS
    workspaces and the rounding of blocks ("allocated"), then the segments' free space ("reserved")."""
    out = dict(breakdown)
    if not device.cuda:
        return tracked, out, tracked, tracked
    out["workspace"] = devices.CUBLAS_WORKSPACE
    out["allocator_rounding"] = max(0, allocator_rounding(run))
    out["allocator_slack"] = max(0, run.cuda_reserved - run.cuda_allocated)
    allocated = tracked + out["workspace"] + out["allocator_rounding"]
    reserved = allocated + out["allocator_slack"]
    out["cuda_context"] = devices.CUDA_CONTEXT
    out["nccl"] = devices.NCCL_BUFFERS if world_size > 1 else 0
    return reserved + out["cuda_context"] + out["nccl"], out, allocated, reserved


def _offloaded(breakdown: dict[str, int], sharded_grads: int) -> dict[str, int]:
    """A phase's breakdown under FSDP's CPU offload: the sharded parameters, gradients (``sharded_grads`` of its
    gradients) and optimizer state on the host. The unsharded gradients, which a step accumulating without
    gradient sync keeps, stay on the device."""
    return {**breakdown, "parameters": 0, "gradients": max(0, breakdown.get("gradients", 0) - sharded_grads),
            "optimizer_state": 0}


def model_state(m: StepMeasurement) -> ModelState:
    """The parameters and gradients a step measured (the optimizer phase's breakdown) and the optimizer state it
    keeps."""
    b = m.optimizer.breakdown or m.breakdown
    params = b.get("parameters", 0)
    # The state a step keeps (held through the next forward/backward; the optimizer phase's peak adds foreach's
    # temporaries, a third more for AdamW). An offloaded optimizer's is on the host: its peak there less the
    # parameters' host copy.
    state = m.forward_backward.breakdown.get("optimizer_state", 0) or b.get("optimizer_state", 0)
    return ModelState(params, b.get("gradients", 0), state or max(0, m.host_peak - params), m.step_tensors)


def plan_result(plan: Plan, step: StepMeasurement, micro: StepMeasurement, device: Device, world_size: int,
            shard_counts: int, source: str = "composed", fb_delta: int = 0, fb_grads: int = 0,
            allocator_run: StepMeasurement | None = None) -> PlanResult:
    """A plan's figures from its sharding's full step, with its own activations' difference (and
    accumulated gradients) added to the forward/backward phase (0 when ``step`` is this plan's own).
    ``allocator_run``: whose simulated caching allocator gives the CUDA rounding and slack (default: the
    plan's own step when measured, else ``micro``)."""
    fb = dict(step.forward_backward.breakdown)
    fb["activations"] = fb.get("activations", 0) + fb_delta
    fb["gradients"] = fb.get("gradients", 0) + fb_grads
    phases = [(step.forward_backward.peak + fb_delta + fb_grads, fb, step.forward_backward.sharded_grads),
              (step.optimizer.peak, dict(step.optimizer.breakdown), step.optimizer.sharded_grads)]
    if source == "measured":  # the plan's own step: the first step's peak counts too
        phases.append((step.peak, dict(step.breakdown), step.sharded_grads))
    if plan.offload == "params" and device.cuda:
        phases = [(sum(_offloaded(b, g).values()), _offloaded(b, g)) for _, b, g in phases]
    elif plan.offload == "optimizer":  # as the tracker counts it: the state and the step's temporaries on the host
        phases = [(peak - b.get("optimizer_state", 0), {**b, "optimizer_state": 0}) for peak, b, _ in phases]
    else:
        phases = [(peak, b) for peak, b, _ in phases]
    tracked, breakdown = max(phases, key=lambda pb: pb[0])
    # The allocator's rounding and slack: the plan's own step's, else its activations' forward/backward's.
    run = allocator_run or (step if source == "measured" else micro)
    peak, breakdown, allocated, reserved = device_figures(tracked, breakdown, device, world_size, run)
    time = step_time(plan, micro, step, model_state(step), device, world_size, shard_counts)
    return PlanResult(plan, peak, breakdown, allocated, reserved, time.seconds, source, time=time)


AUTO_FIT_MARGIN = 0.05  # the recommended plan leaves 5% of the budget free
# A CUDA row "fits" when its predicted device peak leaves this share of the budget free, by how the row was
# predicted: how far under the GPU's such predictions were measured on an H100 (docs/planner.md, "Fits"). Set
# when the worst were -3.0% (a row's own fake step on one device), -3.0% (composed single-device rows) and -5.4%
# (rows whose sharding, FSDP or ZeRO-2, or offload allocates beside the activations); now -1.5%, -1.5% and -4.1%
# (Swin-B under FSDP), kept until FSDP at several ranks is measured. Detectors (a planned input with boxes) fragment
# the segments more and less predictably: DINO Swin-L's rows with the Triton kernel measured -9.2% .. +7.2%.
FIT_MARGINS = {"measured": 0.04, "composed": 0.05, "sharded or offloaded": 0.08, "detection": 0.11}


def fit_margin(r: PlanResult, device: Device, detection: bool = False) -> float:
    """The share of the budget ``r`` must leave free to fit (:data:`FIT_MARGINS`; none on a CPU, whose figures are
    live tensor bytes); ``detection``: the plan's input carries boxes."""
    if not device.cuda:
        return 0.0
    if r.plan.sharding in ("fsdp", "zero2") or r.plan.offload != "none":
        kind = FIT_MARGINS["sharded or offloaded"]
    else:
        kind = FIT_MARGINS["measured" if r.source == "measured" else "composed"]
    return max(kind, FIT_MARGINS["detection"]) if detection else kind


def larger_of(results: list[PlanResult]) -> PlanResult:
    """Of one plan's compositions at several anchors, the one allocating most, with the largest free space in the
    segments any left beside its allocations (each allocator run's slack is measured on its anchor's sharding
    step, and either step's fragmentation can be the plan's)."""
    out = max(results, key=lambda r: (r.allocated, r.peak_bytes))
    more = max(r.reserved - r.allocated for r in results) - (out.reserved - out.allocated)
    if more <= 0:
        return out
    breakdown = {**out.breakdown, "allocator_slack": out.breakdown.get("allocator_slack", 0) + more}
    return replace(out, peak_bytes=out.peak_bytes + more, reserved=out.reserved + more, breakdown=breakdown)


def inputs_at(shard: StepMeasurement, scale: float) -> StepMeasurement:
    """``shard`` with its batches (the next one is prefetched while the step runs) at ``scale`` times their
    micro-batch: a smaller micro-batch's plan holds smaller ones beside its optimizer step."""
    b = shard.optimizer.breakdown
    inputs = b.get("inputs", 0)
    if not inputs:
        return shard
    scaled = int(inputs * scale)
    fb = shard.forward_backward.breakdown  # its peak stays: the activations' line has the batches in it
    fb_inputs = int(fb.get("inputs", 0) * scale)
    fb = {**fb, "inputs": fb_inputs, "activations": fb.get("activations", 0) + fb.get("inputs", 0) - fb_inputs}
    return replace(shard, optimizer=replace(shard.optimizer, peak=shard.optimizer.peak - inputs + scaled,
                                            breakdown={**b, "inputs": scaled}),
                   forward_backward=replace(shard.forward_backward, breakdown=fb))
