"""Predict every plan's per-rank peak memory and relative step time from a few fake steps.

Running the whole step for each of hundreds of plans would take minutes on a large model; the
planner runs three kinds of fake step and composes them:

1. the configured plan, as it is (one optimizer step, its state added to the next forward/backward,
   as :func:`memfit.planner.fake.measure_step` does with ``steps=1``): its row is measured, not composed;
2. one full step per sharding (none/DDP, ZeRO-1, ZeRO-2, FSDP, FSDP + CPU offload) at the
   reference activations (fp32, no checkpointing, no Conv-BN folding, the configured micro-batch):
   the model state, the optimizer phase's peak and the communication of each sharding;
3. one recorded forward/backward without checkpointing per precision (fp32/half) x Conv-BN choice, in a
   single process, at the configured micro-batch and half of it; each checkpointing choice's step is
   composed from it (:mod:`memfit.planner.recompute`), not run.

A plan's forward/backward peak is its sharding's (2) plus how much its activations differ from the
reference's (3); its optimizer-phase peak is its sharding's; its peak is the larger. Activation
differences are additive across the model state because the state is the same tensors either way;
a smaller micro-batch scales the difference by how the reference's batch-dependent bytes scale
(exact for models whose activations are linear in the batch). fp16 and bf16 hold the same bytes.
The recommended plan is then run whole (1) and replaced by its measurement before it is trusted.

Every enumerated plan has the speed levers the target and the model allow (:mod:`memfit.planner.levers`):
channels_last and a fused optimizer run in the fake steps (a plan's sharding and activation steps are run with
its levers); TF32, cuDNN's benchmark and compile are left out of them and priced by the time model. Compiled
twins of the plans are listed only when asked for (``compile``), each with its eager plan's memory.
"""

from __future__ import annotations

import copy
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from memfit.errors import ConfigError
from memfit.measure import CachingAllocatorModel
from memfit.planner.block_subsets import block_subsets
from memfit.planner.devices import Device
from memfit.planner.fake import Phase, StepMeasurement, build_meta_model
from memfit.planner.inputs import Inputs
from memfit.planner.levers import allowed_levers, compiled_twins
from memfit.planner.recompute import CachedTensorMutated, compose
from memfit.planner.results import AUTO_FIT_MARGIN, PlanResult, Prediction, fit_margin, plan_result
from memfit.planner.runs import Runs, StepFailed
from memfit.planner.space import PRECISIONS, ModelFacts, Plan, checkpointed_modules, configured_plan, enumerate_plans

_COMPOSED = ("none", "stages", "blocks", "every2", "selective")  # checkpointing choices composed (and firstN)


def predict(cfg: dict, *, device: Device, world_size: int = 1, budget: int | None = None, as_is: bool = False,
            progress: bool = False, verify: bool = True, inputs: Inputs | None = None, compile: bool = False,
            also: Sequence[Plan] = ()) -> Prediction:
    """Predict the plans of ``cfg`` at ``world_size`` ranks on ``device`` (see the module docstring).

    ``as_is``: only the configured plan. ``compile``: list compiled twins of the plans too (also when the
    config compiles); their memory is their eager plan's. ``also``: plans to predict besides the enumerated
    ones (``memfit bench --plans``). ``budget`` (bytes per rank, default the device's memory)
    decides ``fits`` and the recommendation: the fastest plan within ``budget`` less 5%, verified by a
    whole fake step when ``verify``. Every step runs on the largest batch the train pipeline can make
    (``inputs``, default :class:`~memfit.planner.inputs.Inputs` of ``cfg``).
    """
    start = time.perf_counter()
    budget = budget or device.memory
    if "train_dataloader" not in cfg or "optim_wrapper" not in cfg:
        raise ConfigError("the planner needs train_dataloader and optim_wrapper in the config (it runs the train step)")
    log = logging.getLogger("memfit")
    level = log.level
    log.setLevel(logging.ERROR)  # techniques log each module they touch, precisions their CPU caveats
    try:
        with warnings.catch_warnings():  # FSDP's view-output and autocast notes, once per fake step
            warnings.simplefilter("ignore", UserWarning)
            return _predict(cfg, device, world_size, budget, as_is, progress, verify, start, inputs, compile, also)
    finally:
        log.setLevel(level)


def on_target(cfg: dict, device: Device) -> dict:
    """``cfg`` as its steps run on ``device``: on CUDA, torch's optimizers default to their ``foreach``
    implementation (CPU tensors, which the fake step runs, default to the per-tensor loop). foreach holds
    a parameter-sized temporary while it steps, and is one operator per list, not per tensor."""
    import inspect

    from memfit.registry import OPTIMIZERS

    ow = cfg.get("optim_wrapper")
    opt = ow.get("optimizer") if isinstance(ow, dict) else None
    if not device.cuda or not isinstance(opt, dict) or "foreach" in opt or opt.get("fused"):
        return cfg
    kind = opt.get("type")
    try:
        target = OPTIMIZERS.get(kind) if isinstance(kind, str) else kind
        takes = "foreach" in inspect.signature(target).parameters
    except (ConfigError, KeyError, TypeError, ValueError):
        return cfg
    if not takes:
        return cfg
    return {**cfg, "optim_wrapper": {**ow, "optimizer": {**opt, "foreach": True}}}


def _predict(cfg: dict, device: Device, world_size: int, budget: int, as_is: bool, progress: bool, verify: bool,
             start: float, inputs: Inputs | None, compile: bool, also: Sequence[Plan]) -> Prediction:
    cfg = on_target(cfg, device)
    meta = build_meta_model(cfg["model"])
    facts = ModelFacts.of(meta)
    configured = configured_plan(cfg, facts, device.cuda)
    inputs = inputs or Inputs(cfg)
    levers = allowed_levers(cfg, facts, device, inputs.fixed_size, compile or configured.compile)
    precisions = tuple(p for p in PRECISIONS if device.dtype_tflops(p))
    enumerated = [] if as_is else enumerate_plans(configured, facts, world_size, precisions, device.cuda)
    plans = [levers.on(p) for p in enumerated]
    plans = list(dict.fromkeys([*plans, *(replace(p, configured=False) for p in also)]))
    if levers.compile:
        plans += compiled_twins(plans)
    plans = [p for p in dict.fromkeys(plans) if p != configured]
    ref = Plan("fp32", "none", "none", "none", False, configured.micro_batch, configured.accumulative_counts)
    micro = sorted({p.micro_batch for p in plans} - {configured.micro_batch})
    with Runs(cfg, facts, meta, world_size, progress, device.sms if device.cuda else None, inputs) as runs:
        compose = _Composer(runs, ref, device, world_size, micro)
        runs.collecting = True  # first pass: which fake steps the composition needs; then run them all at once
        runs.run("configured", configured, full=True, steps=1)
        compose.configured_fb(configured)
        for p in plans:
            compose(p)
        runs.collecting = False
        runs.execute()
        try:
            own = runs.run("configured", configured, full=True, steps=1)
            # Compute comes from a forward/backward run, as for every composed row (clipping and loss scaling,
            # which a whole step also runs, are outside the model's operators for all rows alike).
            own_fb = compose.configured_fb(configured)
        except StepFailed as exc:
            raise ConfigError(f"the configured plan ({configured.name}) fails in its fake step: {exc}") from None
        results = [plan_result(configured, own, own_fb, device, world_size, configured.accumulative_counts, "measured")]
        failed: dict[str, list[Plan]] = {}
        for p in plans:
            try:
                results.append(compose(p))
            except StepFailed as exc:
                failed.setdefault(str(exc), []).append(p)
        results += block_subsets(results, len(facts.blocks), budget, compose)
        _rank(results, budget, device)
        recommended = _recommend(results, budget)
        while verify and recommended is not None and results[recommended].source != "measured":
            r = results[recommended]
            try:
                m = runs.run(("verify", r.plan), r.plan, full=True, steps=1)
                measured = plan_result(r.plan, m, m, device, world_size, r.plan.accumulative_counts, "measured")
                results[recommended] = replace(measured, seconds=r.seconds)
            except StepFailed as exc:
                failed.setdefault(str(exc), []).append(results.pop(recommended).plan)
            _rank(results, budget, device)
            recommended = _recommend(results, budget)
        order = sorted(range(len(results)), key=lambda i: (results[i].seconds, results[i].peak_bytes))
        index = {old: new for new, old in enumerate(order)}
        notes = [f"{len(ps)} plan(s) left out, their fake step fails ({', '.join(p.name for p in ps[:3])}"
                 f"{', ...' if len(ps) > 3 else ''}): {why}" for why, ps in failed.items()]
        notes += _stand_in_note(cfg, world_size, configured)
        return Prediction(device, world_size, budget, [results[i] for i in order],
                          index.get(recommended) if recommended is not None else None, time.perf_counter() - start,
                          notes=notes, fake_steps=len(runs.cache), input=inputs.planned(configured.micro_batch),
                          levers=levers)


def _stand_in_note(cfg: dict, world_size: int, configured: Plan) -> list[str]:
    """A line when the configured strategy's own engine cannot run on fake tensors (DeepSpeed, colossalai)."""
    from memfit.strategies import build_strategy

    strategy = build_strategy(copy.deepcopy(cfg.get("strategy")), world_size)
    if strategy.capabilities.fake_step:
        return []
    return [f"the configured {type(strategy).__name__} runs its own engine, which fake tensors cannot: its row is "
            f"the FSDP2/ZeRO-1 step of the same sharding ({configured.sharding}), an estimate of the engine's memory"]


def _half(plan: Plan) -> str:
    return "fp32" if plan.precision == "fp32" else "half"


def compose_checkpointing() -> bool:
    """Whether checkpointing choices are composed from one recorded forward/backward per precision, Conv-BN
    choice and micro-batch (:mod:`memfit.planner.recompute`); ``MEMFIT_PLAN_COMPOSE_AC=0`` runs each instead."""
    return os.environ.get("MEMFIT_PLAN_COMPOSE_AC", "1") != "0"


class _Composer:
    """Composes a plan from its sharding's full step and its activations' forward/backward step.

    The activations' step of every checkpointing choice (none, stages, blocks, every 2nd block, selective, the
    first N blocks) is composed from one recorded forward/backward without checkpointing per precision, Conv-BN
    choice and micro-batch (equal to running it, tests/planner/test_recompute.py). A model whose own
    checkpointing switch is on runs every choice (its recording would miss what its checkpoints save)."""

    def __init__(self, runs: Runs, ref: Plan, device: Device, world_size: int, micro_batches: list[int]) -> None:
        from memfit.memory.wrapping import own_switch

        self.runs, self.ref, self.device, self.world = runs, ref, device, world_size
        self.grad_bytes = sum(p.numel() * p.element_size() for p in runs.meta.parameters() if p.requires_grad)
        # Two reference points, the configured micro-batch and the next smaller one, give the line
        # along which the batch-dependent bytes and FLOPs run for every smaller micro-batch.
        self.half = max(micro_batches) if micro_batches else None
        self.smallest = min(micro_batches) if micro_batches else None
        self.recorded = compose_checkpointing() and not any(own_switch(m) for m in runs.meta.modules())
        self.regions: dict[str, tuple[str, ...]] = {}
        if self.recorded:
            facts = runs.facts
            choices = [c for c in _COMPOSED[1:] if facts.block_types and (c != "stages" or facts.stages)]
            self.regions = {c: checkpointed_modules(runs.meta, facts, c) for c in choices}
        self.record = tuple(sorted({*runs.facts.blocks, *(n for names in self.regions.values() for n in names)}))
        self.composed: dict[tuple, StepMeasurement | StepFailed] = {}
        self.epilogues: dict[int, tuple[int, int]] = {}  # id of a sharding's step -> its epilogue's key

    def _ref(self, plan: Plan) -> Plan:
        """The reference plan with ``plan``'s levers that its fake steps run (channels_last lays activations out
        differently; a fused optimizer steps with other temporaries); the others change no tensor."""
        return replace(self.ref, channels_last=plan.channels_last, fused_optimizer=plan.fused_optimizer)

    def _composes(self, choice: str) -> bool:
        return self.recorded and (choice in _COMPOSED or choice.startswith("first"))

    def _act(self, plan: Plan, mb: int) -> StepMeasurement:
        """The single-process forward/backward of ``plan``'s activation choices at micro-batch ``mb``."""
        ref, choice = self._ref(plan), plan.activation_checkpointing
        composes = self._composes(choice)
        act = replace(ref, precision=plan.precision if plan.precision != "fp16" else "bf16",
                      activation_checkpointing="none" if composes else choice,
                      efficient_conv_bn_eval=plan.efficient_conv_bn_eval, micro_batch=mb,
                      accumulative_counts=max(ref.micro_batch * ref.accumulative_counts // mb, 1))
        if not composes:
            run = self.runs.run(("act", _half(plan), choice, plan.efficient_conv_bn_eval, plan.channels_last, mb),
                                act, full=False, single=True)
            if choice == "none":
                return run
            plain = self._act(replace(plan, activation_checkpointing="none"), mb)  # what recomputation adds
            return replace(run, recompute_ops=max(0, run.ops - plain.ops))
        recorded = self._recorded(plan, mb, act)
        if recorded.timeline is None:  # a placeholder, while the runs are being collected
            return recorded
        key = (_half(plan), choice, plan.efficient_conv_bn_eval, plan.channels_last, mb)
        if key not in self.composed:
            self.composed[key] = self._compose(recorded, choice)
        out = self.composed[key]
        if isinstance(out, StepFailed):
            raise out
        return out

    def _recorded(self, plan: Plan, mb: int, act: Plan | None = None) -> StepMeasurement:
        """The recorded forward/backward without checkpointing of ``plan``'s precision and Conv-BN choice at
        micro-batch ``mb`` (``act``: the plan it runs, needed the first time it is asked for)."""
        return self.runs.run(("record", _half(plan), plan.efficient_conv_bn_eval, plan.channels_last, mb), act,
                             full=False, single=True, record=self.record)

    def _compose(self, recorded: StepMeasurement, choice: str,
                 epilogue: list[tuple[int, int | None]] | None = None) -> StepMeasurement | StepFailed:
        names = self.regions[choice] if choice in self.regions else \
            checkpointed_modules(self.runs.meta, self.runs.facts, choice)  # firstN: no copy of the model
        try:
            k = compose(recorded.timeline, names, selective=choice == "selective", epilogue=epilogue)
        except CachedTensorMutated as exc:  # the plan cannot train: left out with the reason, as a failed run
            return StepFailed(f"RuntimeError: {exc}")
        # Recomputation repeats the convolutions (and attention) in the share the whole forward/backward has them.
        conv = int(k.flops * recorded.conv_flops / recorded.flops) if recorded.flops else 0
        attn = int(k.flops * recorded.attn_flops / recorded.flops) if recorded.flops else 0
        return StepMeasurement(k.peak, {}, Phase(k.peak, {}), Phase(), flops=k.flops, ops=k.ops, written=k.written,
                               peak_without_grads=k.peak_without_grads,
                               cuda_allocated=k.cuda_allocated, cuda_reserved=k.cuda_reserved, conv_flops=conv,
                               cuda_requested=k.cuda_requested, recompute_ops=k.recompute_ops, attn_flops=attn)

    def _allocator_run(self, plan: Plan, mb: int, shard: StepMeasurement) -> StepMeasurement:
        """Whose simulated allocator gives ``plan``'s rounding and slack at micro-batch ``mb``: its forward/backward
        (composed, or its run's own calls) twice, with its sharding's optimizer step between and after (the
        segments a second step finds; an offloaded optimizer's state and step allocate nothing on the device).
        FSDP and ZeRO-2 allocate their buffers around the activations, on streams of their own, which a
        single-device forward/backward cannot show: their rows add what their sharding's step held beyond the
        same two steps of the reference activations (measured at the reference activations, as the optimizer
        phase is)."""
        act = self._act(plan, mb)
        if shard.epilogue is None or not self.device.cuda:
            return act
        epilogue = [] if plan.offload != "none" else shard.epilogue
        # Steps whose optimizer allocates the same (the anchors of one sharding) share their two steps; every
        # offloaded optimizer's (an empty epilogue) are one.
        same_optimizer = self.epilogues.setdefault(id(shard), (hash(tuple(shard.epilogue)), len(shard.epilogue)))
        key = same_optimizer if epilogue else None
        out = self._two_steps(plan, mb, epilogue, key)
        if out is None:
            return act
        if plan.sharding in ("fsdp", "zero2"):
            ref = self._two_steps(self._ref(plan), self.ref.micro_batch, epilogue, key)
            extra = (shard.cuda_reserved - shard.cuda_allocated) - (ref.cuda_reserved - ref.cuda_allocated) if ref \
                else 0
            out = replace(out, cuda_reserved=out.cuda_reserved + max(0, extra))
        return out

    def _slack_at(self, plan: Plan, slack_mb: int, shard: StepMeasurement) -> StepMeasurement:
        """:meth:`_allocator_run` at ``slack_mb``; a smaller micro-batch than that keeps its share of the segments'
        free space (fragmentation grows with the activations: Swin-L's micro-batch 8 x 4 reserved 0.30 GiB beyond
        allocated on an H100, where the two steps at 16 leave 0.63)."""
        run = self._allocator_run(plan, slack_mb, shard)
        if plan.micro_batch >= slack_mb or not run.cuda_reserved:
            return run
        slack = (run.cuda_reserved - run.cuda_allocated) * plan.micro_batch // slack_mb
        return replace(run, cuda_reserved=run.cuda_allocated + slack)

    def _two_steps(self, plan: Plan, mb: int, epilogue: list, key: Any) -> StepMeasurement | None:
        """The simulated allocator's figures of two training steps of ``plan``'s activations at micro-batch
        ``mb`` with ``epilogue`` (see :meth:`_allocator_run`; ``key`` names the epilogue); None where no
        allocator calls were kept."""
        act = self._act(plan, mb)
        full_key = ("two steps", _half(plan), plan.activation_checkpointing, plan.efficient_conv_bn_eval,
                    plan.channels_last, mb, key)
        if full_key in self.composed:
            out = self.composed[full_key]
        elif not self._composes(plan.activation_checkpointing):  # the run's own allocator calls
            if act.allocator_calls is None:
                return None
            first, (trace, streams) = act.allocator_calls
            allocator = CachingAllocatorModel.rerun(trace, streams)
            allocator.finish_steps(first, epilogue, allocator.held_since(first))
            out = self.composed[full_key] = replace(act, cuda_allocated=allocator.peak_allocated,
                                                    cuda_reserved=allocator.peak_reserved,
                                                    cuda_requested=allocator.peak_requested)
        else:
            recorded = self._recorded(plan, mb)  # _act asked for it
            if recorded.timeline is None:
                return None
            out = self.composed[full_key] = self._compose(recorded, plan.activation_checkpointing, epilogue)
        return None if isinstance(out, StepFailed) else out

    def configured_fb(self, configured: Plan) -> StepMeasurement:
        """The configured plan's forward/backward (its compute): composed when its checkpointing is, else run."""
        if self._composes(configured.activation_checkpointing):
            return self._act(configured, configured.micro_batch)
        return self.runs.run("configured-fb", configured, full=False, single=True)

    def _line(self, plan: Plan, mb: int) -> tuple[int, int, int, int, int]:
        """(forward/backward peak, FLOPs, bytes written, convolution FLOPs, attention FLOPs) of ``plan``'s
        activation choices at micro-batch ``mb``: measured at the configured micro-batch and half of it, on the
        line through the two."""
        act = self._act(plan, self.ref.micro_batch)
        figures = (act.forward_backward.peak, act.flops, act.written, act.conv_flops, act.attn_flops)
        if mb == self.ref.micro_batch:
            return figures
        small = self._act(plan, self.half)
        t = (self.ref.micro_batch - mb) / (self.ref.micro_batch - self.half)  # 0 at the configured, 1 at half
        at_half = (small.forward_backward.peak, small.flops, small.written, small.conv_flops, small.attn_flops)
        return tuple(int(a + t * (b - a)) for a, b in zip(figures, at_half))  # type: ignore[return-value]

    def __call__(self, plan: Plan) -> PlanResult:
        ref = self._ref(plan)
        accumulates = plan.accumulative_counts > 1 and ref.accumulative_counts == 1
        anchors = [(ref.micro_batch, ref.accumulative_counts)]
        if accumulates and plan.sharding in ("zero2", "fsdp"):
            # FSDP without gradient sync keeps unsharded gradients and their reduce buffers across micro-steps:
            # measured on steps that accumulate, at half the micro-batch (where activations make the peak)
            # and at the smallest (where the final reduce-scatter's buffers do); the larger composition wins.
            anchors = [(mb, 2) for mb in sorted({self.half, self.smallest}, reverse=True)]
        peak, flops, written, conv, attn = self._line(plan, plan.micro_batch)
        micro = replace(self._act(plan, ref.micro_batch), flops=flops, written=written, conv_flops=conv,
                        attn_flops=attn)
        # The allocator's slack grows with the activations: a smaller micro-batch takes the smaller run's.
        slack_mb = self.half if self.half and plan.micro_batch <= self.half else ref.micro_batch
        results = []
        for mb, k in anchors:
            # Optimizer offload is its sharding's step with the optimizer's memory on the host (plan_result).
            offload = "none" if plan.offload == "optimizer" else plan.offload
            shard = self.runs.run(("shard", plan.sharding, offload, plan.channels_last, plan.fused_optimizer, mb, k),
                                  replace(ref, sharding=plan.sharding, offload=offload, micro_batch=mb,
                                          accumulative_counts=k), full=True, steps=1)
            fb_grads = 0
            if accumulates and k == 1:
                # DDP and ZeRO-1 accumulate into whole gradients that stay through every later micro-step, which
                # adds to them the peak of all its forward/backward holds but its own gradients (those accumulate in
                # place), wherever in backward that falls (checkpointing moves it).
                act = self._act(plan, slack_mb)
                fb_grads = self.grad_bytes - (act.forward_backward.peak - act.peak_without_grads)
            results.append(plan_result(plan, shard, micro, self.device, self.world, k,
                                   fb_delta=peak - self._line(ref, mb)[0], fb_grads=fb_grads,
                                   allocator_run=self._slack_at(plan, slack_mb, shard)))
        return replace(max(results, key=lambda r: r.peak_bytes), seconds=results[0].seconds)


def _rank(results: list[PlanResult], budget: int, device: Device) -> None:
    base = results[0].seconds or 1.0
    for r in results:
        r.rel_step_time = r.seconds / base
        r.fits = r.peak_bytes <= budget * (1 - fit_margin(r, device))


def _recommend(results: list[PlanResult], budget: int) -> int | None:
    limit = budget * (1 - AUTO_FIT_MARGIN)
    fitting = [i for i, r in enumerate(results) if r.peak_bytes <= limit and r.fits]
    return min(fitting, key=lambda i: (results[i].seconds, results[i].peak_bytes)) if fitting else None
