"""The step-time model: what a plan costs relative to another on a target device.

One optimizer step of a plan with k micro-steps takes

    compute  = k * (FLOPs per micro-step / (peak TFLOPs of its precision * efficiency)
                    + 2 * bytes written by FLOP-less operators / memory bandwidth + ops * launch cost)
    comm     = bytes each rank sends and receives / interconnect bandwidth  (FSDP: parameters gathered
               every micro-step, gradients reduce-scattered once; DDP: one all-reduce; ZeRO-1: an all-reduce
               and the parameters' broadcast)
    offload  = host<->device bytes / host bandwidth  (FSDP CPU offload: the parameter shard in every
               all-gather, the gradient shard out; optimizer offload: the parameters and gradients out,
               the parameters back) + the optimizer step on the host
    optimizer = bytes the optimizer reads and writes (parameters, gradients, state) / memory bandwidth
    step     = max(compute, comm) + offload + optimizer     (communication overlaps compute; offload waits)

FLOPs come from ``torch.utils.flop_counter``'s formulas over the operators the fake step dispatched,
so activation checkpointing's recomputation is counted as it runs; operator counts carry the fixed
per-kernel cost that makes small micro-batches slower. Only ratios are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planner.devices import Device
from memfit.planner.fake import StepMeasurement
from memfit.planner.space import Plan

HOST_STEP_BYTES_PER_S = 20e9  # an optimizer step on the host CPU (either offload) touches state at ~20 GB/s


@dataclass(frozen=True)
class ModelState:
    """Per-rank bytes the optimizer step touches and an offload moves."""

    params: int
    grads: int
    optimizer: int


def step_seconds(plan: Plan, micro: StepMeasurement, shard: StepMeasurement, state: ModelState, device: Device,
                 world_size: int, shard_counts: int) -> float:
    """Modelled seconds of one optimizer step of ``plan``: ``micro`` is its forward/backward measurement
    (FLOPs, ops), ``shard`` the full step of its sharding (collective bytes over ``shard_counts``
    micro-steps), ``state`` its per-rank model state."""
    rate = device.dtype_tflops(plan.precision) or device.dtype_tflops("fp32")
    k = plan.accumulative_counts
    compute = k * (micro.flops / (rate * 1e12 * device.efficiency) + 2 * micro.written / (device.mem_bw * 1e9)
                   + micro.ops * device.launch_us * 1e-6)
    ring = (world_size - 1) / world_size if world_size > 1 else 0.0
    gathers = shard.comm.get("gather", 0) / max(shard_counts, 1) * k
    traffic = ring * (gathers + shard.comm.get("reduce", 0) + shard.comm.get("broadcast", 0))
    if plan.sharding in ("none", "zero1") and world_size > 1:
        traffic += 2 * ring * state.grads  # DDP's all-reduce (the planner runs DDP unwrapped; see fake.py)
    comm = traffic / (device.link_bw * 1e9)
    offload = 0.0
    moved = state.params + state.grads + 2 * state.optimizer
    if plan.offload == "params":
        passes = 2 if plan.sharding == "fsdp" else 1  # re-gathered in backward unless kept (zero2)
        offload = (k * passes * state.params + state.grads) / (device.host_bw * 1e9)
        optimizer = moved / HOST_STEP_BYTES_PER_S
    elif plan.offload == "optimizer":
        offload = (2 * state.params + state.grads) / (device.host_bw * 1e9)
        optimizer = moved / HOST_STEP_BYTES_PER_S
    else:
        optimizer = moved / (device.mem_bw * 1e9)
    return max(compute, comm) + offload + optimizer
