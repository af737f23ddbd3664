"""One training step of a config on fake tensors, at any world size, measured by memfit's tracker.

The model is built on ``meta`` and materialised inside ``FakeTensorMode``, so a 197M-parameter
Swin-L costs no memory and no FLOPs here; the strategy's own code (DDP, ZeRO-1, FSDP2) wraps it
over a fake process group of N ranks in this one process, so sharding is the real code path, not a
formula. The step is the runner's: :func:`memfit.connector.setup` applies precision, memory
techniques and strategy, and ``model.train_step`` runs the optimizer wrapper's micro-steps.

Two kinds of run (:func:`measure_step`):

- ``full``: two optimizer steps of k micro-steps each, so the optimizer state exists; the peaks of
  the second step's forward/backward phase and optimizer phase are reported apart (the planner
  composes them) with the tracker's breakdown at each. ``steps=1`` runs one optimizer step and adds
  the optimizer state it created to the forward/backward phase, which is what the second step holds,
  and replays the step's allocations in the simulated CUDA allocator as the second step makes them
  (:meth:`CachingAllocatorModel.replay`): the planner's runs take this, half the time of two steps
  and the same figures (tests/planner/test_fake_steps.py).
- ``forward_backward``: one micro-step without an optimizer step, for the activation side of a plan
  (its peak, FLOPs including recomputation, and operator count).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memfit.errors import ConfigError
from memfit.measure import CachingAllocatorModel, MemoryTracker, optimizer_state_tensors, storages
from memfit.measure.storages import stepped_params
from memfit.optim.spec import OptimWrapperSpec
from memfit.planner.devices import CUBLAS_BLOCKS
from memfit.planner.kernel_scratch import H100_SMS, cuda_scratch
from memfit.planner.op_counter import OpCounter
from memfit.planner.space import technique_cfg
from memfit.planner.step_calls import INPUT_STREAM, ddp_buckets, optimizer_epilogue, stream_reserved
from memfit.planner.sync_points import SYNC_ONLY


@dataclass
class Phase:
    """Peak bytes of a phase and the tracker's breakdown at that peak; ``sharded_grads``: of its gradients, FSDP's
    sharded ones (on the host under FSDP's CPU offload)."""

    peak: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    sharded_grads: int = 0


@dataclass
class StepMeasurement:
    """What one fake run measured (per rank). ``flops``: one micro-step's forward and backward,
    recomputation included (``conv_flops`` of them in convolutions); ``written``: bytes its FLOP-less
    operators write; ``comm``: bytes per optimizer step by kind (gather | reduce | broadcast)."""

    peak: int
    breakdown: dict[str, int]
    forward_backward: Phase
    optimizer: Phase
    flops: int = 0
    ops: int = 0
    written: int = 0
    comm: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # CUDA targets: the caching allocator's peaks, simulated over the run (cuBLAS workspaces included).
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    # A recorded forward/backward (measure_step's ``record``), from which checkpointing choices are composed.
    timeline: Any = None
    host_peak: int = 0  # host memory an offloaded optimizer held (not in ``peak``)
    sharded_grads: int = 0  # of the gradients at ``peak``, FSDP's sharded ones (as Phase's)
    conv_flops: int = 0
    attn_flops: int = 0  # of ``flops``: fused attention's
    step_ops: int = 0  # operators of one optimizer step (foreach: a few per list; fused: one per list)
    step_tensors: int = 0  # parameter tensors the optimizer steps (this rank's)
    recompute_ops: int = 0  # a composed forward/backward: the operators its recomputation adds (of ``ops``)
    # A one-step full run on a CUDA target: its optimizer step's allocator calls (optimizer_epilogue), for replays.
    epilogue: list[tuple[int, int | None]] | None = None
    cuda_requested: int = 0  # a composed run: the bytes its allocator replay requested at their peak
    # A forward/backward run: the peak of all but the gradients (what a later micro-step adds to whole gradients).
    peak_without_grads: int = 0
    # A forward/backward run on a CUDA target: where its step began in its allocator calls, the calls, and where
    # its backward returned (its optimizer step's place in a full step: what follows is the train step returning).
    allocator_calls: tuple[int, tuple, int] | None = None
    # A full run with ``record`` (or a composed forward/backward): its tracked bytes at the sync points of its
    # micro-steps' forward/backward (memfit.planner.sync_points), in its forward/backward phase's terms.
    sync: Any = None
    # A full run on a CUDA target: what its simulated allocator reserved on the streams its sharding allocates on
    # (FSDP2's all-gathers and reduce-scatters; all but the default stream and the batches' copy stream).
    stream_reserved: int = 0
    shard_trace: Any = None  # a full run with ``record``: its allocator calls (memfit.planner.sync_points.ShardTrace)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process (rank 0), torn down afterwards.

    Collectives return at once; DDP's constructor checks (which read tensor values) are skipped and
    its reducer's all-reduce is replaced by a hook returning the bucket, as an in-place all-reduce
    leaves it. Refused inside a real process group: plan before launching, or in a subprocess.
    """
    from torch.nn.parallel import distributed as ddp_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if tdist.is_initialized():
        raise ConfigError("the planner runs before training starts, outside a process group: run `memfit plan` "
                          "(or --auto-fit) from one process, not under torchrun")
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    verify = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = verify
        tdist.destroy_process_group()


class _Phases:
    """Splits a tracker's peak into the forward/backward phase and the optimizer phase of the last
    optimizer step, through the global optimizer step hooks."""

    def __init__(self, tracker: MemoryTracker, allocator: CachingAllocatorModel | None = None) -> None:
        self.tracker = tracker
        self.allocator = allocator
        self.fb = Phase()
        self.opt = Phase()
        self.depth = 0  # ZeRO-1's step calls the inner optimizer's: only the outermost step is a phase
        self.opt_mark = 0  # the allocator's calls before the last optimizer step
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def _snapshot(self) -> Phase:
        return Phase(*self.tracker.peak_so_far())

    def reset(self) -> None:
        self.tracker.reset_peak()

    def _pre(self, *args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.fb = self._snapshot()
        self.opt_mark = len(self.allocator.trace) if self.allocator is not None else 0
        self.overall = max(getattr(self, "overall", Phase()), self.fb, key=lambda p: p.peak)
        self.reset()

    def _post(self, *args: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        self.opt = self._snapshot()
        self.overall = max(self.overall, self.opt, key=lambda p: p.peak)
        self.reset()

    def close(self) -> Phase:
        for h in self._handles:
            h.remove()
        tail = self._snapshot()
        return max(getattr(self, "overall", Phase()), tail, key=lambda p: p.peak)


def build_meta_model(model_cfg: Any) -> nn.Module:
    """The config's model on the meta device (no memory, no initialisation)."""
    from memfit.registry import MODELS

    if isinstance(model_cfg, nn.Module):
        return copy.deepcopy(model_cfg).to("meta")
    with torch.device("meta"):
        return MODELS.build(copy.deepcopy(model_cfg), key="model")


def _materialise(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``model.to_empty(device='cpu')`` for a meta model inside ``mode``, without running an operator per
    tensor: each meta parameter and buffer becomes a fake CPU tensor of its metadata (shared ones stay
    shared). Five times faster than ``to_empty`` on Swin-L's 364 parameters."""
    converter, cpu = mode.fake_tensor_converter, torch.device("cpu")
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, as_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    fake = converter.from_meta_and_device(mode, t, cpu)
                    made[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if as_param else fake
                table[name] = made[id(t)]
    return model


def measured_optim_wrapper(optim_cfg: Any, full: bool) -> Any:
    """The ``optim_wrapper`` config as :func:`measure_step` runs it (a shallow copy when it changes).

    fp16 holds the same bytes as bf16, but GradScaler.step reads found_inf on the host (.item()), which
    fake tensors cannot answer: fp16 is measured as bf16 (the scaler's state is a few scalars). A
    forward/backward run (not ``full``) is the first micro-step of two: backward without a step."""
    if not isinstance(optim_cfg, dict):
        return optim_cfg
    optim_cfg = dict(optim_cfg)
    if str(optim_cfg.get("dtype", "")).removeprefix("torch.") == "float16":
        optim_cfg["dtype"] = "bfloat16"
    if not full:
        optim_cfg["accumulative_counts"] = 2
    return optim_cfg


def first_batch(loader_cfg: dict) -> Any:
    """One real batch from the train dataloader config (no workers, one rank)."""
    from memfit.data import build_dataloader

    cfg = {**loader_cfg, "num_workers": 0, "persistent_workers": False}
    cfg.pop("prefetch_factor", None)
    return next(iter(build_dataloader(cfg, seed=0, key="train_dataloader")))


def measure_step(cfg: dict, *, full: bool = True, batch: Any = None, meta_model: nn.Module | None = None,
                 steps: int = 2, cuda: bool = False, record: tuple[str, ...] | None = None,
                 sms: tuple[int, int] = H100_SMS) -> StepMeasurement:
    """Run the config's training step on fake tensors inside the current (fake) process group.

    ``full``: two optimizer steps (see the module docstring); otherwise one micro-step's forward and
    backward. ``batch`` defaults to the largest batch ``cfg['train_dataloader']`` can make
    (:mod:`memfit.planner.inputs`); ``meta_model``
    (a model already built on meta) is copied instead of building the config's model again. ``cuda``:
    the target is a CUDA device, so autocast casts as CUDA's does (:mod:`memfit.planner.cuda_autocast`), of
    ``sms`` (SMs, threads per SM: how far kernels split, :mod:`memfit.planner.kernel_scratch`).
    ``record``: a forward/backward run records its timeline (:mod:`memfit.planner.timeline`), with the calls
    of the modules so named as the regions checkpointing choices are composed over; its own figures are then
    not the step's (the recording keeps no saved tensor): compose them from ``timeline``. A full run records the
    :class:`~memfit.planner.sync_points.SyncProfile` of its micro-steps' forward/backward (``sync``), as does a
    forward/backward whose ``record`` begins with :data:`SYNC_ONLY` (its figures then the step's own).
    """
    import time

    from memfit.connector import setup
    from memfit.measure.target import measured_for
    from memfit.optim.builder import scale_lr_cfg
    from memfit.planner.cuda_autocast import cuda_autocast_on_cpu
    from memfit.planner.real_paths import real_paths
    from memfit.planner.sync_points import SyncRecorder
    from memfit.planner.timeline import Recorder
    from memfit.precision import precision_options
    from memfit.strategies import build_strategy

    start = time.perf_counter()
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    strategy = build_strategy(copy.deepcopy(cfg.get("strategy")), world)
    if not strategy.capabilities.fake_step:
        kind = type(strategy).__name__
        raise ConfigError(f"strategy={kind!r}: the planner runs FSDP2 and ZeRO-1 (DDP) steps on fake tensors, not "
                          f"{kind}'s engine; plan without --as-is to see its ZeRO stages as FSDP plans")
    strategy.prepare_fake_step()  # e.g. DDP runs unwrapped; its buckets are added as communication memory
    strategy.setup_env("none")
    strategy.device = torch.device("cpu")  # fake CPU tensors: fake CUDA cannot run backward without a GPU
    strategy.precision.to_device(strategy.device)
    if batch is None:
        from memfit.planner.inputs import Inputs

        batch = Inputs(cfg).batch()
    model = copy.deepcopy(meta_model) if meta_model is not None else build_meta_model(cfg["model"])
    techniques = technique_cfg(cfg)
    optim_cfg = measured_optim_wrapper(copy.deepcopy(cfg["optim_wrapper"]), full)
    optim_cfg = scale_lr_cfg(optim_cfg, cfg.get("auto_scale_lr"), lambda: cfg["train_dataloader"]["batch_size"] * world)
    counts = OptimWrapperSpec.of(optim_cfg).accumulative_counts
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        model = _materialise(model, fake_mode)
        model.train()
        precision = precision_options(cfg.get("precision"))
        model, wrapper = setup(model, strategy, optim_cfg, techniques, precision=precision,
                               optimizer_offload=bool(techniques.get("optimizer_offload")))
        buckets = strategy.communication_bytes(model)
        micro_steps = steps * counts if full else 1
        # A forward/backward run is the first micro-step of a window of two that does not end here (a
        # window cut short by the end of training would step the optimizer).
        wrapper.initialize_count_status(model, 0, micro_steps if full else 2)
        counter = OpCounter()
        allocator = CachingAllocatorModel() if cuda else None
        epilogue = None
        recorder: Recorder | SyncRecorder | None = None
        sync_only = record is not None and record[:1] == (SYNC_ONLY,)
        if record is not None:
            modules = dict(model.named_modules())
            regions = {n: modules[n] for n in record if n in modules}
            recorder = SyncRecorder(model, regions) if full or sync_only else Recorder(regions, allocator, model)
        observer = recorder.observe(counter) if recorder is not None else counter
        with counter, MemoryTracker(model, wrapper.optimizer, observer=observer, allocator=allocator) as tracker, \
                cuda_autocast_on_cpu(cuda), real_paths(cuda), measured_for("cuda" if cuda else None):
            if allocator is not None:  # allocated before the step's first kernels: workspaces, DDP's buckets
                for i, n in enumerate(CUBLAS_BLOCKS + ddp_buckets(buckets)):
                    allocator.malloc(("before the step", i), n)
                live = tracker.live_storages
                live.scratch = functools.partial(cuda_scratch, sms=sms)
                # The Runner copies each batch to a GPU on a stream of its own, the next one while this step
                # runs (memfit.data.prefetch): the batch is in that stream's pool, and the next one beside it.
                live.input_stream = INPUT_STREAM
                for i, st in enumerate(storages(batch)):
                    live.hold(("next batch", i), st.nbytes(), "inputs", INPUT_STREAM)
            phases = _Phases(tracker, allocator)
            first = step_at = len(allocator.trace) if allocator is not None else 0
            if recorder is not None:
                recorder.mode = tracker.live_storages
            if not full:  # where the optimizer step would begin: when backward returns (an optim wrapper's)
                def backward_returned() -> None:
                    nonlocal step_at
                    step_at = len(allocator.trace) if allocator is not None else 0
                    if isinstance(recorder, Recorder):
                        recorder.timeline.step_at = len(recorder.events)

                _after_backward(strategy, backward_returned)
            try:
                with _data_dependent_is_config_error(cfg), recorder or contextlib.nullcontext():
                    for i in range(micro_steps):
                        counter.counting = (i == micro_steps - 1) if not full else i >= micro_steps - counts
                        model.train_step(batch, optim_wrapper=wrapper)
            finally:  # its optimizer hooks are global: a step that failed must not leave them behind
                overall = phases.close()
            fb_without_grads = tracker.live_storages.peak_without_grads
        held = buckets  # beside the step's tracked bytes, in its phases' figures
        if full and steps == 1:
            # Every later forward/backward runs beside the optimizer state the first step created (and
            # is otherwise the same): add it rather than run a second step.
            state = sum({id(st): st.nbytes() for st in storages(optimizer_state_tensors(tracker.optimizer))}.values())
            held += state
            fb = phases.fb
            fb.peak += state
            fb.breakdown["optimizer_state"] = fb.breakdown.get("optimizer_state", 0) + state
            overall = max(overall, fb, key=lambda p: p.peak)
            if allocator is not None:  # the second step's requests, on the first's segments and beside its state
                epilogue = optimizer_epilogue(allocator.trace[phases.opt_mark:])
                allocator.replay(first)
    for phase in {id(p): p for p in (overall, phases.fb, phases.opt)}.values():  # overall is one of them
        phase.peak += buckets
        phase.breakdown["communication"] = phase.breakdown.get("communication", 0) + buckets
    flops_per_micro = counter.flops // (counts if full else 1)
    own_calls = allocator is not None and not full and (record is None or sync_only)
    calls = (first, allocator.calls(), step_at) if own_calls else None
    return StepMeasurement(epilogue=epilogue, allocator_calls=calls,
                           peak=overall.peak, breakdown=overall.breakdown, sharded_grads=overall.sharded_grads,
                           forward_backward=phases.fb if full else overall, optimizer=phases.opt,
                           flops=flops_per_micro, ops=counter.ops // (counts if full else 1),
                           conv_flops=counter.conv_flops // (counts if full else 1), step_ops=counter.step_ops,
                           attn_flops=counter.attn_flops // (counts if full else 1),
                           written=counter.written // (counts if full else 1),
                           comm=dict(counter.comm), seconds=time.perf_counter() - start,
                           cuda_allocated=allocator.peak_allocated if allocator else 0,
                           cuda_reserved=allocator.reserved_beside_strays() if allocator else 0,
                           timeline=recorder.timeline if isinstance(recorder, Recorder) else None,
                           sync=recorder.profile.shifted(held) if isinstance(recorder, SyncRecorder) else None,
                           shard_trace=recorder.trace if isinstance(recorder, SyncRecorder) else None,
                           host_peak=tracker.host_peak_bytes,
                           stream_reserved=stream_reserved(allocator) if full else 0,
                           peak_without_grads=0 if full else fb_without_grads,
                           step_tensors=len(stepped_params(tracker.optimizer)) if full else 0)


def _after_backward(strategy: Any, then: Any) -> None:
    """Call ``then()`` each time ``strategy``'s backward (every optim wrapper's) returns."""
    backward = strategy.backward

    def backward_then(loss: torch.Tensor, **kwargs: Any) -> None:
        backward(loss, **kwargs)
        then()

    strategy.backward = backward_then


@contextlib.contextmanager
def _data_dependent_is_config_error(cfg: dict) -> Iterator[None]:
    """A step that reads tensor values (``.item()``, ``.tolist()``, ``nonzero`` shapes) cannot run on fake
    tensors, which hold none: one line naming the model and where it read, instead of torch's exception."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        skip = (f"{os.sep}torch{os.sep}", f"memfit{os.sep}memory{os.sep}", f"memfit{os.sep}measure{os.sep}",
                f"memfit{os.sep}planner{os.sep}")
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(s in f.filename for s in skip)]
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        model = cfg["model"].get("type", "the model") if isinstance(cfg.get("model"), dict) else "the model"
        raise ConfigError(f"{model}'s train step reads tensor values on the host ({exc}{where}), which the planner's "
                          "fake tensors do not have: it cannot be predicted without the GPU; measure it with "
                          "`memfit bench` on the device, or keep .item()/.tolist()/data-dependent shapes out of "
                          "the step") from None
