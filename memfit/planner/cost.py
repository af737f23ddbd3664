"""The step-time model: what a plan costs relative to another on a target device.

One optimizer step of a plan with k micro-steps takes

    kernels  = k * (FLOPs per micro-step / (peak TFLOPs of its precision * efficiency)
                    + 2 * bytes written by FLOP-less operators / (memory bandwidth * model_memory_bound))
               + optimizer (on CUDA): bytes it reads and writes (parameters, gradients, state) / memory bandwidth
                 x foreach's several passes or fused's one
    host     = on CUDA: per operator launch_us x host_op_factor (k micro-steps' operators, recomputed operators
               recompute_op_factor more, and one per parameter tensor for each micro-step after the first, which
               adds to the gradients) + selective checkpointing's policy per recomputed operator + FSDP2's work per
               parameter tensor and pass (gathered twice a micro-step under FSDP, once under ZeRO-2; reduced once a
               step) x fsdp_tensor_us + the optimizer step's operators (foreach) or parameter tensors (fused)
    comm     = bytes each rank sends and receives / interconnect bandwidth  (FSDP: parameters gathered
               every micro-step, gradients reduce-scattered once; DDP: one all-reduce; ZeRO-1: an all-reduce
               and the parameters' broadcast)
    offload  = host<->device bytes / host bandwidth  (FSDP CPU offload: the parameter shard in every
               all-gather, the gradient shard out; optimizer offload: the parameters and gradients out,
               the parameters back) + the optimizer step on the host
    step     = max(max(kernels, host), comm) + offload on CUDA (the host queues kernels ahead of the device, and
               the slower of the two sets the pace; communication overlaps; offload waits);
               max(kernels + host, comm) + offload on a CPU, where operators run as they are dispatched

FLOPs come from ``torch.utils.flop_counter``'s formulas over the operators the fake step dispatched,
so activation checkpointing's recomputation is counted as it runs; operator counts carry the host's cost per
operator that paces a step of small kernels. Only ratios are reported.

The speed levers (:mod:`memfit.planner.levers`) on CUDA: an fp32 plan's convolutions run at the TF32 rate
(cuDNN allows TF32 by default) and, with ``tf32``, its matmuls too; ``channels_last`` and
``cudnn_benchmark`` scale the convolutions' seconds; ``compile`` scales FLOP seconds, memory-bound bytes
and launches; a fused optimizer makes one pass over its tensors where foreach makes several. The factors
are :data:`LEVER_FACTORS`, one table.

A target's step-time profile (:mod:`memfit.planner.time_profile`, measured by ``memfit bench --calibrate``)
replaces the constants where it has a factor: the efficiency by precision for matmul-like and for convolution
FLOPs (channels_last's measured in place of its lever), the memory-bound bandwidth, the cost per operator, the
host bandwidth and the optimizer's passes and per-operator cost. Without one the constants below apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planner.devices import Device
from memfit.planner.fake import StepMeasurement
from memfit.planner.space import Plan
from memfit.planner.time_profile import Profile, profile_for

# An optimizer step on the host CPU (either offload) touches its state at this rate where a profile has no
# ``host_step_gbps`` (measured by ``memfit bench --calibrate``: AdamW on the host over ViT-B's tensors).
HOST_STEP_BYTES_PER_S = 20e9
# FSDP2's host work per parameter tensor each time it gathers a unit's parameters or reduces its gradients (its
# per-parameter bookkeeping in Python: the unsharded views, the copies into and out of the collective's buffer,
# the sharded gradient), where a profile has no ``fsdp_tensor_us``. Fitted to the H100's steps at one rank
# (benchmarks/gpu_calibration_h100*.json, torch 2.11, 16-core host): Swin-L fp16 under FSDP took 66 ms over the
# same step without it (0.147 s against 0.081), Swin-B bf16 under FSDP 0.156-0.188 s; both have 329 parameter
# tensors, gathered twice and reduced once a step. 80 us put their steps relative to Swin-L fp32's at +15% (Swin-L)
# and -17% / -0.4% (Swin-B, the two runs); without it they were -35% and -56% / -47%. On a third machine, with the
# host paced apart from the kernels (step = the slower): -4.6% and +6.4%.
FSDP_TENSOR_US = 80.0
# Selective checkpointing's host cost per operator its recomputation runs, beyond plain checkpointing's (its policy
# is a Python dispatch mode over every operator of the region, in forward and again in the recomputation), where a
# profile has no ``selective_op_us``: ViT-L/16's H100 steps paid 16 us (benchmarks/gpu_calibration_h100_run3.json;
# 27 and 0 us on two other machines), Swin-L's 16 us on one machine and 73 us on another, unexplained; CPUs 13-17 us.
SELECTIVE_OP_US = 16.0
# The three below are fitted to one H100 machine's steps (benchmarks/gpu_calibration_h100_run3.json, torch 2.11, a
# 16-core host; its profile is memfit/planner/profiles/h100.json): each case's profiled step says how long its
# kernels ran by family and when its Python returned (docs/planner.md, "Step-time model").
# A step's host seconds per operator the fake step counts, over the profile's ``launch_us`` (a loop of tiny
# operators), where a profile has no ``host_op_factor``: a model's operators cost more (module code, hooks,
# autocast's casts, the optimizer wrapper). ViT-L/16 and Swin-L in half precision: 15 us (launch_us 8.4 us).
HOST_OP_FACTOR = 1.81
# The share of the calibration's memory-bound rate (large elementwise operators) that a model's FLOP-less kernels
# reach, counted as the fake step counts them (2 x bytes written), where a profile has no ``model_memory_bound``:
# smaller tensors, reductions, strided copies, more bytes read than written. The kernels outside matmuls and
# attention ran at 0.22-0.31 of the table's bandwidth for ViT-L/16 and Swin-L (the calibration's: 0.70), 0.19-0.21
# for DINO.
MODEL_MEMORY_BOUND = 0.34
# A recomputed operator's host cost beyond an ordinary operator's, in operators, where a profile has no
# ``recompute_op_factor``: checkpointing runs its recomputation from autograd's hooks. 0.7-1.2 for ViT-L/16's
# checkpointed steps, 0.5-0.7 for Swin-L's.
RECOMPUTE_OP_FACTOR = 0.8

# The speed levers' factors by device family (Device.family); a family without a row takes "default"'s.
# Checked against benchmarks/gpu_throughput.py on one H100 (torch 2.11, 2026-11-26; raw numbers in
# benchmarks/gpu_throughput_h100.json), ResNet-50 160 px batch 128 and ViT-B/16 224 px batch 64. Its bf16
# lever paths vary +-10% from block to block (four 15-step blocks each), so they bound these factors rather
# than fit them; the fp32 TF32 pairs are steady (within 0.6%).
LEVER_FACTORS: dict[str, dict[str, float]] = {
    "default": {
        # x the convolutions' seconds: cuDNN's fast convolution kernels are NHWC; NCHW inputs are transposed
        # around them (3.9 of ResNet-50's 33.6 ms of kernels a step, benchmarks/runner_gap_h100.json). Predicted
        # 1.016x for ResNet-50 bf16; measured 1.028x (median of 4 blocks, against the plain loop).
        "channels_last": 0.8,
        # x the convolutions' seconds: the fastest algorithm, tuned once per input size. Predicted 1.008x for
        # ResNet-50 bf16; measured 1.012x against the plain loop.
        "cudnn_benchmark": 0.9,
        # compile (the whole model in one graph, as the planner's compiled plans apply it): matmuls and
        # convolutions run the same kernels (x FLOP seconds 1.0); inductor fuses the memory-bound operators and
        # launches fewer kernels (x bytes written, x launches). Fitted to the CUDA kernel time per step on one H100
        # (benchmarks/gpu_throughput.py --compile --profile, torch 2.11, benchmarks/gpu_throughput_h100_compile.json):
        # ResNet-50 bf16 channels_last+fused 20.4 -> 14.3 ms (predicted 0.744x, measured 0.70x), ViT-B/16 bf16
        # fused 28.3 -> 21.9 ms (predicted 0.733x, measured 0.774x). Regional compile (the config's compile=True)
        # costs host time per compiled block that this model leaves out (docs/speed.md).
        "compile_flops": 1.0,
        "compile_written": 0.55,
        "compile_ops": 0.55,
        # x the data sheet's TF32 rate for matmuls with tf32=True: fitted to ViT-B/16 fp32 (measured 2.854x
        # with tf32; predicted 3.29x at the data sheet's rate). ResNet-50 fp32: predicted 1.001x, measured 1.011x
        # (its convolutions already run in TF32, cuDNN's default).
        "tf32_matmul_rate": 0.70,
        # foreach's optimizer traffic over fused's one pass: AdamW's _multi_tensor_adamw reads and writes ~20
        # parameter-sized tensors per step (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv), the fused
        # kernel 7 (reads parameters, gradients, both moments; writes parameters and moments), counted in
        # torch/optim/adamw.py. Predicted 1.013x for ResNet-50 bf16 and 1.028x for ViT-B; measured 1.060x
        # against the plain loop (ResNet-50) and within the blocks' spread (ViT-B).
        "optimizer_foreach_passes": 20 / 7,
    },
}


def lever_factor(device: Device, key: str, profile: Profile | None = None) -> float:
    """A speed lever's factor on ``device``: its profile's, else :data:`LEVER_FACTORS`'."""
    table = LEVER_FACTORS.get(device.family, {}).get(key, LEVER_FACTORS["default"][key])
    return (profile or profile_for(device)[0]).number(key, table)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's modelled seconds by part: the device's ``kernels``, the ``host``'s Python and launches,
    ``comm`` (collectives, overlapped) and ``offload`` (host<->device copies and a host optimizer step, waited for).
    ``seconds`` puts them together as a step runs on ``cuda`` (the slower of kernels and host) or a CPU (their sum)."""

    kernels: float
    host: float
    comm: float = 0.0
    offload: float = 0.0
    cuda: bool = True

    @property
    def compute(self) -> float:
        """The kernels with their host: on a GPU the slower of the two, on a CPU their sum."""
        return max(self.kernels, self.host) if self.cuda else self.kernels + self.host

    @property
    def seconds(self) -> float:
        return max(self.compute, self.comm) + self.offload

    @property
    def bound(self) -> str:
        """The largest part of the step: 'offload' (host<->device copies and the host's optimizer step), 'comm'
        (collectives longer than the compute they overlap), 'host' (a GPU waits for Python to launch its
        kernels) or 'device'."""
        if self.offload > max(self.compute, self.comm):
            return "offload"
        if self.comm > self.compute:
            return "comm"
        return "host" if self.cuda and self.host > self.kernels else "device"


@dataclass(frozen=True)
class ModelState:
    """Per-rank bytes the optimizer step touches and an offload moves."""

    params: int
    grads: int
    optimizer: int
    tensors: int = 0  # parameter tensors the optimizer steps


def step_time(plan: Plan, micro: StepMeasurement, shard: StepMeasurement, state: ModelState, device: Device,
              world_size: int, shard_counts: int) -> StepTime:
    """Modelled seconds of one optimizer step of ``plan``, by part: ``micro`` is its forward/backward measurement
    (FLOPs, ops), ``shard`` the full step of its sharding (collective bytes over ``shard_counts``
    micro-steps), ``state`` its per-rank model state."""
    profile = profile_for(device)[0]
    k = plan.accumulative_counts
    kernels, host = micro_step_parts(plan, micro, device, profile)
    kernels, host = k * kernels, k * host + sharding_host_seconds(plan, state, device, profile)
    if device.cuda:  # each micro-step after the first adds its gradients to the ones held: one operator a tensor
        host += (k - 1) * state.tensors * host_op_seconds(device, profile)
    ring = (world_size - 1) / world_size if world_size > 1 else 0.0
    gathers = shard.comm.get("gather", 0) / max(shard_counts, 1) * k
    traffic = ring * (gathers + shard.comm.get("reduce", 0) + shard.comm.get("broadcast", 0))
    if plan.sharding in ("none", "zero1") and world_size > 1:
        traffic += 2 * ring * state.grads  # DDP's all-reduce (the planner runs DDP unwrapped; see fake.py)
    comm = traffic / (device.link_bw * 1e9)
    offload = 0.0
    moved = state.params + state.grads + 2 * state.optimizer
    # A host step runs at least the operators the device's step ran (torch's CPU default is a loop per tensor), each
    # at least what the device's foreach step pays per operator.
    launch_us = profile.number("launch_us", device.launch_us)
    host_launches = shard.step_ops * profile.number("optimizer_foreach_op_us", launch_us) * 1e-6 if device.cuda else 0.0
    host_bw = device.host_bw * profile.number("host_bw", 1.0)
    host_step = profile.number("host_step_gbps", HOST_STEP_BYTES_PER_S / 1e9) * 1e9
    if plan.offload == "params":
        passes = 2 if plan.sharding == "fsdp" else 1  # re-gathered in backward unless kept (zero2)
        offload = (k * passes * state.params + state.grads) / (host_bw * 1e9) + moved / host_step + host_launches
    elif plan.offload == "optimizer":
        offload = (2 * state.params + state.grads) / (host_bw * 1e9) + moved / host_step + host_launches
    elif device.cuda:
        step_kernels, step_host = optimizer_parts(plan, state, device, shard.step_ops, profile)
        kernels, host = kernels + step_kernels, host + step_host
    else:
        kernels += moved / (device.mem_bw * 1e9)
    # On a GPU the host runs ahead of the kernels it launches: the slower of the two sets the pace (StepTime).
    return StepTime(kernels, host, comm, offload, device.cuda)


def sharding_host_seconds(plan: Plan, state: ModelState, device: Device, profile: Profile | None = None) -> float:
    """FSDP2's host seconds of one optimizer step of ``plan`` on a CUDA device: its work per parameter tensor
    (``state.tensors``, this rank's) each time it gathers them (twice a micro-step under FSDP: forward and
    backward; once under ZeRO-2, which keeps them until backward) or reduces their gradients (once a step)."""
    if not device.cuda or plan.sharding not in ("fsdp", "zero2"):
        return 0.0
    passes = plan.accumulative_counts * (2 if plan.sharding == "fsdp" else 1) + 1
    us = (profile or profile_for(device)[0]).number("fsdp_tensor_us", FSDP_TENSOR_US)
    return passes * state.tensors * us * 1e-6


def host_op_seconds(device: Device, profile: Profile) -> float:
    """The host's seconds per operator of a training step: on a GPU, the profile's ``launch_us`` (a loop of tiny
    operators) x ``host_op_factor``; on a CPU, its measured cost per operator."""
    launch = profile.number("launch_us", device.launch_us) * 1e-6
    return launch * profile.number("host_op_factor", HOST_OP_FACTOR) if device.cuda else launch


def micro_step_parts(plan: Plan, micro: StepMeasurement, device: Device,
                     profile: Profile | None = None) -> tuple[float, float]:
    """Modelled seconds of one forward/backward of ``plan`` (``micro``'s FLOPs, bytes written and operators)
    with its speed levers (the module docstring), timed by ``profile`` (default: the device's): the kernels'
    (FLOPs and bytes) and the host's (its operators)."""
    profile = profile or profile_for(device)[0]
    fp32 = device.dtype_tflops("fp32")
    if plan.precision == "fp32":
        tf32 = device.dtype_tflops("tf32") if device.cuda else None
        conv_rate, rate, dtype = tf32 or fp32, fp32, "fp32"
        if tf32 and plan.tf32:  # a measured TF32 efficiency takes the place of the lever's rate
            rate, dtype = (tf32 if profile.has("matmul", "tf32") else tf32 * lever_factor(device, "tf32_matmul_rate",
                                                                                           profile)), "tf32"
    else:
        conv_rate = rate = device.dtype_tflops(plan.precision) or fp32
        dtype = plan.precision if device.dtype_tflops(plan.precision) else "fp32"
    conv_dtype = "fp32" if dtype == "tf32" else dtype
    layout = "conv_channels_last" if device.cuda and plan.channels_last and profile.has("conv_channels_last",
                                                                                        conv_dtype) else "conv"
    conv = micro.conv_flops / (conv_rate * 1e12 * profile.efficiency(layout, conv_dtype, device.efficiency))
    other = (micro.flops - micro.conv_flops - micro.attn_flops) / (
        rate * 1e12 * profile.efficiency("matmul", dtype, device.efficiency))
    # Fused attention at its own measured rate where the profile has one (else a matmul's).
    kind = "attention" if profile.has("attention", dtype) else "matmul"
    other += micro.attn_flops / (rate * 1e12 * profile.efficiency(kind, dtype, device.efficiency))
    bandwidth = device.mem_bw * 1e9 * profile.number("memory_bound", 1.0)
    if device.cuda:  # a model's FLOP-less kernels run slower than the calibration's large elementwise ones
        bandwidth *= profile.number("model_memory_bound", MODEL_MEMORY_BOUND)
    written = 2 * micro.written / bandwidth
    host = micro.ops * host_op_seconds(device, profile)
    if device.cuda and plan.activation_checkpointing != "none":
        # checkpointing's recomputation runs from Python in backward: a recomputed operator costs the host more
        host += micro.recompute_ops * host_op_seconds(device, profile) * profile.number(
            "recompute_op_factor", RECOMPUTE_OP_FACTOR)
        if plan.activation_checkpointing == "selective":
            host += micro.recompute_ops * profile.number("selective_op_us", SELECTIVE_OP_US) * 1e-6
    if device.cuda:
        if plan.channels_last and layout == "conv":
            conv *= lever_factor(device, "channels_last", profile)
        if plan.cudnn_benchmark:
            conv *= lever_factor(device, "cudnn_benchmark", profile)
        if plan.compile:
            flops = lever_factor(device, "compile_flops", profile)
            conv, other = conv * flops, other * flops
            written *= lever_factor(device, "compile_written", profile)
            host *= lever_factor(device, "compile_ops", profile)
    return conv + other + written, host


def micro_step_seconds(plan: Plan, micro: StepMeasurement, device: Device, profile: Profile | None = None) -> float:
    """Modelled seconds of one forward/backward of ``plan`` (:func:`micro_step_parts`): on a GPU the slower of
    its kernels and its host, on a CPU their sum."""
    kernels, host = micro_step_parts(plan, micro, device, profile)
    return max(kernels, host) if device.cuda else kernels + host


def optimizer_pass_seconds(state: ModelState, device: Device) -> float:
    """Seconds of one pass over the optimizer's tensors at the table's memory bandwidth: parameters, gradients
    and state read, parameters and state written."""
    return (2 * state.params + state.grads + 2 * state.optimizer) / (device.mem_bw * 1e9)


def optimizer_parts(plan: Plan, state: ModelState, device: Device, ops: int = 0,
                    profile: Profile | None = None) -> tuple[float, float]:
    """Modelled seconds of an optimizer step of ``ops`` operators (as the fake step ran it) on a CUDA device, the
    kernels' and the host's: a fused step is one pass (:func:`optimizer_pass_seconds`), foreach several; the host
    pays per operator (foreach) or per parameter tensor (fused)."""
    profile = profile or profile_for(device)[0]
    launch_us = profile.number("launch_us", device.launch_us)
    if plan.fused_optimizer:
        passes = profile.number("optimizer_fused_passes", 1.0)
        if profile.number("optimizer_fused_tensor_us", -1.0) >= 0:
            # The fused kernel's host cost grows with the tensors it is given, not with its few launches.
            per_tensor = profile.number("optimizer_fused_tensor_us", 0.0)
            return optimizer_pass_seconds(state, device) * passes, state.tensors * per_tensor * 1e-6
        op_us = launch_us
    else:
        passes = lever_factor(device, "optimizer_foreach_passes", profile)
        op_us = profile.number("optimizer_foreach_op_us", launch_us)
    return optimizer_pass_seconds(state, device) * passes, ops * op_us * 1e-6


def optimizer_seconds(plan: Plan, state: ModelState, device: Device, ops: int = 0,
                      profile: Profile | None = None) -> float:
    """:func:`optimizer_parts`' kernels and host, one after the other."""
    return sum(optimizer_parts(plan, state, device, ops, profile))
