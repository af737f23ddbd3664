"""How the planner composes a plan's row from a few fake steps (:mod:`memfit.planner.predict`'s module docstring):
its sharding's full step, its activations' forward/backward, and the simulated CUDA allocator's two steps."""

from __future__ import annotations

import os
from dataclasses import replace

from memfit.planner.devices import Device
from memfit.planner.fake import Phase, StepMeasurement
from memfit.planner.levers import Levers
from memfit.planner.recompute import CachedTensorMutated, compose
from memfit.planner.results import PlanResult, inputs_at, larger_of, plan_result
from memfit.planner.row_allocator import RowAllocator, activations_key, precision_kind
from memfit.planner.runs import Runs, StepFailed
from memfit.planner.sharded_peak import sharded_peak
from memfit.planner.sharded_replay import ShardedRows
from memfit.planner.space import Plan, checkpointed_modules
from memfit.planner.sync_points import SYNC_ONLY
from memfit.planner.timeline_scale import scaled_recording

_COMPOSED = ("none", "stages", "blocks", "every2", "selective")  # checkpointing choices composed (and firstN)


def compose_checkpointing() -> bool:
    """Whether checkpointing choices are composed from one recorded forward/backward per precision, Conv-BN
    choice and micro-batch (:mod:`memfit.planner.recompute`); ``MEMFIT_PLAN_COMPOSE_AC=0`` runs each instead."""
    return os.environ.get("MEMFIT_PLAN_COMPOSE_AC", "1") != "0"


class Composer(RowAllocator):
    """Composes a plan from its sharding's full step and its activations' forward/backward step.

    The activations' step of every checkpointing choice (none, stages, blocks, every 2nd block, selective, the
    first N blocks) is composed from one recorded forward/backward without checkpointing per precision, Conv-BN
    choice and micro-batch (equal to running it, tests/planner/test_recompute.py). A model whose own
    checkpointing switch is on runs every choice (its recording would miss what its checkpoints save)."""

    def __init__(self, runs: Runs, ref: Plan, device: Device, world_size: int, micro_batches: list[int],
                 levers: Levers | None = None) -> None:
        from memfit.memory.wrapping import own_switch

        self.runs, self.ref, self.device, self.world = runs, ref, device, world_size
        self.levers = levers  # the rows' levers: a row whose optimizer steps on the host shares a fused step (_shard)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in runs.meta.parameters() if p.requires_grad)
        # What a single-process forward/backward holds from its start besides the batches.
        self.model_bytes = sum(t.numel() * t.element_size() for t in (*runs.meta.parameters(), *runs.meta.buffers()))
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
        self.scaled: dict[tuple, StepMeasurement | None] = {}  # recordings at other micro-batches, scaled
        self.epilogues: dict[int, tuple[int, int]] = {}  # id of a sharding step's epilogue -> its key
        self.sharded = ShardedRows()

    def in_order(self, plans: list[Plan]) -> list[Plan]:
        """``plans`` in the order to compose them: those of the same activations one after another."""
        return sorted(plans, key=lambda p: activations_key(p, p.micro_batch))

    def _ref(self, plan: Plan) -> Plan:
        """The reference plan with ``plan``'s levers that its fake steps run (channels_last lays activations out
        differently; a fused optimizer steps with other temporaries); the others change no tensor."""
        return replace(self.ref, channels_last=plan.channels_last, fused_optimizer=plan.fused_optimizer)

    def _composes(self, choice: str) -> bool:
        return self.recorded and (choice in _COMPOSED or choice.startswith("first"))

    def _act_plan(self, plan: Plan, mb: int, choice: str) -> Plan:
        """The single-process forward/backward that runs ``plan``'s precision and Conv-BN choice with checkpointing
        ``choice`` at micro-batch ``mb``."""
        ref = self._ref(plan)
        return replace(ref, precision=plan.precision if plan.precision != "fp16" else "bf16",
                       activation_checkpointing=choice, efficient_conv_bn_eval=plan.efficient_conv_bn_eval,
                       micro_batch=mb, accumulative_counts=max(ref.micro_batch * ref.accumulative_counts // mb, 1))

    def _act(self, plan: Plan, mb: int) -> StepMeasurement:
        """The single-process forward/backward of ``plan``'s activation choices at micro-batch ``mb``."""
        choice = plan.activation_checkpointing
        if not self._composes(choice):
            # Run as it is, its sync points recorded: a sharded row takes its sharding's buffers at them
            run = self.runs.run(("act", *activations_key(plan, mb)), self._act_plan(plan, mb, choice), full=False,
                                single=True, record=(SYNC_ONLY, *self.record))
            if choice == "none":
                return run
            plain = self._act(replace(plan, activation_checkpointing="none"), mb)  # what recomputation adds
            return replace(run, recompute_ops=max(0, run.ops - plain.ops))
        recorded = self._recorded(plan, mb)
        if recorded.timeline is None:  # a placeholder, while the runs are being collected
            return recorded
        key = activations_key(plan, mb)
        if key not in self.composed:
            self.composed[key] = self._compose(recorded, choice)
        out = self.composed[key]
        if isinstance(out, StepFailed):
            raise out
        return out

    def _recorded(self, plan: Plan, mb: int) -> StepMeasurement:
        """The recorded forward/backward without checkpointing of ``plan``'s precision and Conv-BN choice at
        micro-batch ``mb``. Recorded at the configured micro-batch and half of it; every other micro-batch is
        scaled from those two (:mod:`memfit.planner.timeline_scale`), or recorded where they cannot be."""
        key = ("record", precision_kind(plan), plan.efficient_conv_bn_eval, plan.channels_last)
        if self.half is not None and mb not in (self.ref.micro_batch, self.half):
            if (*key, mb) not in self.scaled:
                lo, hi = self._recorded(plan, self.half), self._recorded(plan, self.ref.micro_batch)
                if lo.timeline is None or hi.timeline is None:  # placeholders, while the runs are being collected
                    return lo
                self.scaled[(*key, mb)] = scaled_recording(lo, hi, (self.half, self.ref.micro_batch), mb)
            if self.scaled[(*key, mb)] is not None:
                return self.scaled[(*key, mb)]  # type: ignore[return-value]
        return self.runs.run((*key, mb), self._act_plan(plan, mb, "none"), full=False, single=True,
                             record=self.record)

    def _checkpointed(self, choice: str) -> tuple[str, ...]:
        """The modules checkpointing ``choice`` checkpoints (firstN: worked out each time, no copy of the model)."""
        return self.regions[choice] if choice in self.regions else \
            checkpointed_modules(self.runs.meta, self.runs.facts, choice)

    def _compose(self, recorded: StepMeasurement, choice: str, epilogue: list[tuple[int, int | None]] | None = None,
                 micro_steps: int = 1, before: tuple[int, ...] = ()) -> StepMeasurement | StepFailed:
        try:
            k = compose(recorded.timeline, self._checkpointed(choice), selective=choice == "selective",
                        epilogue=epilogue, micro_steps=micro_steps, before=before)
        except CachedTensorMutated as exc:  # the plan cannot train: left out with the reason, as a failed run
            return StepFailed(f"RuntimeError: {exc}")
        # Recomputation repeats the convolutions (and attention) in the share the whole forward/backward has them.
        conv = int(k.flops * recorded.conv_flops / recorded.flops) if recorded.flops else 0
        attn = int(k.flops * recorded.attn_flops / recorded.flops) if recorded.flops else 0
        return StepMeasurement(k.peak, {}, Phase(k.peak, {}), Phase(), flops=k.flops, ops=k.ops, written=k.written,
                               peak_without_grads=k.peak_without_grads,
                               cuda_allocated=k.cuda_allocated, cuda_reserved=k.cuda_reserved, conv_flops=conv,
                               cuda_requested=k.cuda_requested, recompute_ops=k.recompute_ops, attn_flops=attn,
                               sync=k.sync)

    def configured_fb(self, configured: Plan) -> StepMeasurement:
        """The configured plan's forward/backward (its compute): composed when its checkpointing is, else run."""
        if self._composes(configured.activation_checkpointing):
            return self._act(configured, configured.micro_batch)
        return self.runs.run("configured-fb", configured, full=False, single=True)

    def _line(self, plan: Plan, mb: int) -> tuple[int, int, int, int, int, int]:
        """(forward/backward peak, its peak of all but the gradients, FLOPs, bytes written, convolution FLOPs,
        attention FLOPs) of ``plan``'s activation choices at micro-batch ``mb``: composed at ``mb`` where they are
        composed from recordings, else measured at the configured micro-batch and half of it, on the line
        through the two."""
        def figures(act: StepMeasurement) -> tuple[int, ...]:
            return (act.forward_backward.peak, act.peak_without_grads, act.flops, act.written, act.conv_flops,
                    act.attn_flops)

        if mb == self.ref.micro_batch or self._composes(plan.activation_checkpointing):
            return figures(self._act(plan, mb))  # type: ignore[return-value]
        at_ref, at_half = figures(self._act(plan, self.ref.micro_batch)), figures(self._act(plan, self.half))
        t = (self.ref.micro_batch - mb) / (self.ref.micro_batch - self.half)  # 0 at the configured, 1 at half
        return tuple(int(a + t * (b - a)) for a, b in zip(at_ref, at_half))  # type: ignore[return-value]

    def _at_reduce_scatter(self, shard: StepMeasurement, mb: int, plan_mb: int, without_grads: int,
                           ref_without_grads: int) -> int:
        """What a plan at micro-batch ``plan_mb`` (its forward/backward's peak beside the gradients
        ``without_grads``) adds to ``shard``'s peak, a ZeRO-2 or FSDP step accumulating at the smallest
        micro-batch ``mb`` (whose own is ``ref_without_grads``). Its peak is late in the last micro-step's
        backward, where the final reduce-scatters' buffers are and few activations are left: those scale as the
        activations' peak does (checkpointing shrinks both), the batches as the micro-batch."""
        inputs = shard.forward_backward.breakdown.get("inputs", 0)
        plan_inputs = inputs * plan_mb // mb
        at_peak = ref_without_grads - self.model_bytes - inputs
        if at_peak <= 0:
            return without_grads - ref_without_grads
        ratio = (without_grads - self.model_bytes - plan_inputs) / at_peak
        left = shard.forward_backward.breakdown.get("activations", 0)
        return int(left * (ratio - 1)) + plan_inputs - inputs

    def _same_activations(self, plan: Plan, mb: int) -> bool:
        """Whether ``plan``'s composed forward/backward at micro-batch ``mb`` holds what the reference's does, step
        by step (its sync points' figures): its sharding's step is then the row's own."""
        row = self._act(plan, mb).sync
        return row is not None and row == self._act(self._ref(plan), mb).sync

    def _sharded_peak(self, plan: Plan, ref: Plan, shard: StepMeasurement, mb: int) -> int | None:
        """The peak of ``plan``'s forward/backward under its sharding (``shard``: the sharding's step of the
        reference activations at micro-batch ``mb``), from the sharding's bytes at each sync point of the step
        (:func:`~memfit.planner.sharded_peak.sharded_peak`): of each micro-step where the step accumulates (the first
        keeps its unsharded gradients; the last holds them from its start and reduce-scatters them), else of its one
        forward/backward; None where a step has no sync points."""
        if shard.sync is None:
            return None
        ref_sync, row_sync = self._act(ref, mb).sync, self._act(plan, plan.micro_batch).sync
        if ref_sync is None or row_sync is None:
            return None
        steps = shard.sync.micro_steps()
        if len(steps) == 1:
            if self._same_activations(plan, mb):
                return shard.forward_backward.peak
            return sharded_peak(steps[0], ref_sync, row_sync)
        first = sharded_peak(steps[0], ref_sync, row_sync)
        later = sharded_peak(steps[-1], ref_sync.later, row_sync.later)
        return None if first is None or later is None else max(first, later)

    def _shard(self, plan: Plan, ref: Plan, mb: int, k: int) -> StepMeasurement:
        """``plan``'s sharding's full step of the reference activations at micro-batch ``mb`` and ``k`` micro-steps."""
        # Optimizer offload is its sharding's step with the optimizer's memory on the host (plan_result); ZeRO-2's
        # runs with the offload, whose buffers' slack differs (ViT-B at 8 ranks, benchmarks/composed_rows.py: its
        # rows reserved -5.3% .. -2.2% of their own fake steps from the step without it, now -3.4% .. +1.8%).
        offload = "none" if plan.offload == "optimizer" and plan.sharding != "zero2" else plan.offload
        fused = self._device_fused(plan)
        # A ZeRO-2 or FSDP step records its sync points (memfit.planner.sync_points).
        sync = self.record if plan.sharding in ("zero2", "fsdp") else None
        return self.runs.run(("shard", plan.sharding, offload, plan.channels_last, fused, mb, k),
                             replace(ref, sharding=plan.sharding, offload=offload, micro_batch=mb,
                                     accumulative_counts=k, fused_optimizer=fused), full=True, steps=1, record=sync)

    def _device_fused(self, plan: Plan) -> bool:
        """Whether ``plan``'s sharding step runs a fused optimizer: its own, or, for a row whose optimizer steps on the
        host and whose step runs without the offload (FSDP's CPU offload, which moves nothing on fake tensors;
        optimizer offload but ZeRO-2's), the same row's on the device where it has one. The two steps differ in the
        optimizer's temporaries only, which are the host's (results.plan_result takes the optimizer's memory out):
        one fake step pair fewer per sharding. Its host's operators are counted apart (:meth:`_host_step`)."""
        if self.levers is None or plan.offload == "none" or (plan.offload == "optimizer" and plan.sharding == "zero2"):
            return plan.fused_optimizer
        return plan.fused_optimizer or self.levers.on(replace(plan, offload="none")).fused_optimizer

    def _host_step(self, plan: Plan) -> StepMeasurement | None:
        """The operators of ``plan``'s optimizer step on the host, where its sharding's step ran another optimizer
        (:meth:`_device_fused`): its optimizer's step alone (memfit.planner.host_step), one per optimizer."""
        if self._device_fused(plan) == plan.fused_optimizer:
            return None
        host = replace(self.ref, offload=plan.offload if plan.offload == "optimizer" else "none",
                       fused_optimizer=plan.fused_optimizer)
        return self.runs.run(("host step", host.offload, host.fused_optimizer), host, full=True, single=True,
                             optimizer_only=True)

    def __call__(self, plan: Plan) -> PlanResult:
        ref = self._ref(plan)
        accumulates = plan.accumulative_counts > 1 and ref.accumulative_counts == 1
        anchors = [(ref.micro_batch, ref.accumulative_counts)]
        if accumulates and plan.sharding in ("zero2", "fsdp"):
            # FSDP without gradient sync keeps unsharded gradients and their reduce buffers across micro-steps:
            # measured on steps that accumulate, at half the micro-batch (where activations make the peak)
            # and at the smallest (where the final reduce-scatter's buffers do); the larger composition wins.
            anchors = [(mb, 2) for mb in sorted({self.half, self.smallest}, reverse=True)]
        peak, without_grads, flops, written, conv, attn = self._line(plan, plan.micro_batch)
        micro = replace(self._act(plan, ref.micro_batch), flops=flops, written=written, conv_flops=conv,
                        attn_flops=attn)
        shards = {(mb, k): self._shard(plan, ref, mb, k) for mb, k in anchors}
        try:
            host = self._host_step(plan)
        except StepFailed:  # a count only: the row keeps its sharding step's operators rather than be left out
            host = None
        if host is not None:
            shards = {a: replace(s, step_ops=host.step_ops) for a, s in shards.items()}
        nearest = min(anchors, key=lambda a: abs(a[0] - plan.micro_batch))  # whose step rounds as the plan's would
        results = []
        for mb, k in anchors:
            shard = shards[(mb, k)]
            ref_peak, ref_without_grads = self._line(ref, mb)[:2]
            fb_delta, fb_grads = peak - ref_peak, 0
            at = self._sharded_peak(plan, ref, shard, mb) if plan.sharding in ("zero2", "fsdp") else None
            if at is not None:
                fb_delta = at - shard.forward_backward.peak
            elif accumulates and k == 1:
                # DDP and ZeRO-1 accumulate into whole gradients that stay through every later micro-step: beside
                # them, the peak of all its forward/backward holds but its own gradients (those accumulate in
                # place), wherever in backward that falls (checkpointing moves it). The reference step's
                # gradients at its peak are in its breakdown.
                fb_grads = self.grad_bytes - shard.forward_backward.breakdown.get("gradients", 0)
                fb_delta = without_grads + self.grad_bytes - ref_peak - fb_grads
            elif accumulates and mb == self.half:
                # ZeRO-2 and FSDP without gradient sync keep the unsharded gradients through the later micro-steps,
                # which the anchor's step already holds (it accumulates): the activations differ by their peaks
                # beside the gradients.
                fb_delta = without_grads - ref_without_grads
            elif accumulates:
                fb_delta = self._at_reduce_scatter(shard, mb, plan.micro_batch, without_grads, ref_without_grads)
            elif plan.sharding in ("zero2", "fsdp"):
                # Their gradients are reduce-scattered as backward makes them, each rank keeping its shard: of the
                # whole gradients a single device holds at its peak (a checkpointed step's is late in backward,
                # where most are made) a rank holds its share. (Swin-L at 8 ranks, benchmarks/composed_rows.py:
                # `bf16 ac:blocks fsdp mb32x1` allocated +32% of its own fake step with the whole gradients.)
                grads = (peak - without_grads) - (ref_peak - ref_without_grads)
                fb_delta = without_grads - ref_without_grads + grads // self.world
            if plan.micro_batch != mb:
                shard = inputs_at(shard, plan.micro_batch / mb)
            run = self._slack_at(plan, shard, (mb, k), (shards[nearest], nearest))
            results.append(plan_result(plan, shard, micro, self.device, self.world, k, fb_delta=fb_delta,
                                       fb_grads=fb_grads, allocator_run=run))
        return replace(larger_of(results), seconds=results[0].seconds)

