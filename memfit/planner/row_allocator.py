"""How a composed row's CUDA memory is simulated (:class:`RowAllocator`, the planner's :class:`~memfit.planner.composer.
Composer`): its forward/backward's allocations through the simulated caching allocator over two training steps, on
one device or in its sharding's recorded step (:mod:`memfit.planner.sharded_replay`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memfit.measure import CachingAllocatorModel
from memfit.planner.fake import StepMeasurement
from memfit.planner.recompute import compose
from memfit.planner.results import allocator_rounding
from memfit.planner.runs import StepFailed
from memfit.planner.space import Plan
from memfit.planner.step_calls import bucket_calls, ddp_buckets


def precision_kind(plan: Plan) -> str:
    """The precision ``plan``'s activations are recorded in: "fp32", or "half" (fp16 records as bf16 does)."""
    return "fp32" if plan.precision == "fp32" else "half"


def activations_key(plan: Plan, mb: int) -> tuple:
    """What ``plan``'s composed forward/backward at micro-batch ``mb`` depends on."""
    return precision_kind(plan), plan.activation_checkpointing, plan.efficient_conv_bn_eval, plan.channels_last, mb


class RowAllocator:
    """The simulated allocator's part of the :class:`~memfit.planner.composer.Composer` (its attributes and its
    composed forward/backward steps are the composer's)."""

    def _allocator_run(self, plan: Plan, mb: int, shard: StepMeasurement, anchor: tuple[int, int],
                       rounding_at: tuple[StepMeasurement, tuple[int, int]]) -> StepMeasurement:
        """Whose simulated allocator gives ``plan``'s rounding and slack at micro-batch ``mb``: its forward/backward
        (composed, or its run's own calls) twice, with its sharding's optimizer step between and after (the
        segments a second step finds; an offloaded optimizer's state and step allocate nothing on the device).
        FSDP and ZeRO-2 allocate their buffers around the activations, on streams of their own, which a
        single-device forward/backward cannot show: their rows run in their sharding's step (:meth:`_sharded_run`);
        where that cannot be, they add the segments of those streams in their sharding's step (one that accumulates:
        what its step held beyond the same two steps of the reference activations at its ``anchor``, micro-batch
        and micro-steps). ``rounding_at``: the sharding's step (and its anchor) nearest the plan's micro-batch,
        whose blocks' rounding an FSDP row then takes."""
        act = self._act(plan, mb)
        if shard.epilogue is None or not self.device.cuda:
            return act
        if plan.sharding in ("fsdp", "zero2"):
            sharded = self._sharded_run(plan, mb, shard, act, anchor[0])
            if sharded is not None:
                return sharded
        epilogue = [] if plan.offload != "none" else shard.epilogue
        # Steps whose optimizer allocates the same (the anchors of one sharding) share their two steps; every
        # offloaded optimizer's (an empty epilogue) are one.
        same_optimizer = self.epilogues.setdefault(id(shard.epilogue), (hash(tuple(shard.epilogue)),
                                                                        len(shard.epilogue)))
        key = same_optimizer if epilogue else None
        out = self._two_steps(plan, mb, epilogue, key, plan.accumulative_counts, _buckets(plan, shard))
        if out is None:
            return act
        if plan.sharding in ("fsdp", "zero2"):
            ref = self._two_steps(self._ref(plan), anchor[0], epilogue, key, anchor[1])
            if ref is None:
                return out
            allocated = out.cuda_allocated
            slack = out.cuda_reserved - out.cuda_allocated
            if plan.accumulative_counts == 1 and mb == anchor[0] and self._same_activations(plan, mb):
                slack = shard.cuda_reserved - shard.cuda_allocated  # the sharding's step is the row's own
            elif plan.accumulative_counts == 1:
                # The free space the row's activations leave in the default stream's segments (its two steps), and
                # the segments of the streams its sharding allocates on, which only its own buffers use: their size
                # is the sharding step's, whatever the activations beside (Swin-L at 8 ranks: 864 MiB in each of
                # its FSDP and ZeRO-2 rows' own fake steps).
                slack += shard.stream_reserved
            else:  # what the sharding's step (accumulating at the anchor) left free beyond the same activations'
                slack += max(0, (shard.cuda_reserved - shard.cuda_allocated) - (ref.cuda_reserved - ref.cuda_allocated))
            r_shard, r_anchor = rounding_at
            r_ref = None
            if plan.sharding == "fsdp":
                r_ref = ref if r_anchor == anchor else self._two_steps(self._ref(plan), r_anchor[0], epilogue, key,
                                                                       r_anchor[1])
            if r_ref is not None:
                # The blocks' rounding likewise: the sharding step's own (its gradients are shards and views into
                # the reduce-scatter's buffer, not the single device's whole tensors, each rounded) at the anchor
                # nearest the plan's micro-batch (activations round by their size), and what the plan's activations
                # round beyond the reference's there. (ViT-B at 8 ranks, benchmarks/composed_rows.py: FSDP rows'
                # allocated -0.1% .. +3.4% of their own fake steps, were -3.0% .. +6.5%; ZeRO-2 rows, whose
                # gathered parameters stay through backward, came out 1-2% lower, so they keep the replay's.)
                rounding = allocator_rounding(r_shard) + allocator_rounding(out) - allocator_rounding(r_ref)
                allocated += max(0, rounding) - allocator_rounding(out)
            out = replace(out, cuda_allocated=allocated, cuda_reserved=allocated + slack)
        return out

    def _sharded_run(self, plan: Plan, mb: int, shard: StepMeasurement, act: StepMeasurement, shard_mb: int
                     ) -> StepMeasurement | None:
        """``act`` with the simulated allocator's figures of ``plan``'s composed forward/backward at micro-batch
        ``mb`` run in its sharding's step ``shard`` at ``shard_mb`` (:mod:`memfit.planner.sharded_replay`), of one
        micro-step or accumulating as the plan does; None where that cannot be (a checkpointing choice not composed,
        a step whose micro-steps are not the plan's). Swin-L and ViT-B/6 at 8 ranks
        (benchmarks/composed_rows.py): reserved -1.5% .. +2.9% of the rows' own fake steps (were -6.0% .. +11.7%)."""
        if shard.shard_trace is None or not self._composes(plan.activation_checkpointing):
            return None
        # An optimizer offloaded beside FSDP is its step without the offload (Composer._shard), whose state and step
        # allocate nothing on the device, fused or not.
        host_optimizer = plan.offload == "optimizer" and plan.sharding != "zero2"
        sharding = (plan.sharding, plan.offload, None if host_optimizer else plan.fused_optimizer)
        figures = self.sharded(shard.shard_trace, activations_key(plan, mb), sharding, not host_optimizer,
                               min(plan.accumulative_counts, 3), lambda: self._events(plan, mb), mb / shard_mb)
        if figures is None:
            return None
        return replace(act, cuda_allocated=figures[0], cuda_reserved=figures[1], cuda_requested=figures[2])

    def _events(self, plan: Plan, mb: int) -> list[tuple]:
        """The allocations and frees of ``plan``'s composed forward/backward at micro-batch ``mb``, in order."""
        choice = plan.activation_checkpointing
        events: list[tuple] = []
        compose(self._recorded(plan, mb).timeline, self._checkpointed(choice), selective=choice == "selective",
                events=events)
        return events

    def _slack_at(self, plan: Plan, shard: StepMeasurement, anchor: tuple[int, int],
                  rounding_at: tuple[StepMeasurement, tuple[int, int]]) -> StepMeasurement:
        """:meth:`_allocator_run` at ``plan``'s micro-batch where its recording scales to it; else at the configured
        micro-batch or half of it, a smaller one keeping its share of their segments' free space (fragmentation
        grows with the activations: Swin-L's micro-batch 8 x 4 reserved 0.30 GiB beyond allocated on an H100,
        where the two steps at 16 leave 0.63)."""
        if self._composes(plan.activation_checkpointing):
            return self._allocator_run(plan, plan.micro_batch, shard, anchor, rounding_at)
        slack_mb = self.half if self.half and plan.micro_batch <= self.half else self.ref.micro_batch
        run = self._allocator_run(plan, slack_mb, shard, anchor, rounding_at)
        if plan.micro_batch >= slack_mb or not run.cuda_reserved:
            return run
        slack = (run.cuda_reserved - run.cuda_allocated) * plan.micro_batch // slack_mb
        return replace(run, cuda_reserved=run.cuda_allocated + slack)

    def _two_steps(self, plan: Plan, mb: int, epilogue: list, key: Any, micro_steps: int,
                   before: tuple[int, ...] = ()) -> StepMeasurement | None:
        """The simulated allocator's figures of two training steps of ``plan``'s activations at micro-batch
        ``mb`` with ``epilogue`` (see :meth:`_allocator_run`; ``key`` names the epilogue), each of ``micro_steps``
        (more than one: a second forward/backward adds its gradients to the first's), after blocks of ``before``
        bytes that stay (DDP's buckets, :func:`_buckets`); None where no allocator calls were kept."""
        act = self._act(plan, mb)
        micro_steps = min(micro_steps, 2)  # the third and later micro-steps find the segments the second left
        full_key = ("two steps", *activations_key(plan, mb), key, micro_steps, before)
        if full_key in self.composed:
            out = self.composed[full_key]
        elif not self._composes(plan.activation_checkpointing):  # the run's own allocator calls
            if act.allocator_calls is None:
                return None
            first, (trace, streams), step_at = act.allocator_calls
            calls = [(key, n, streams.get(i, 0)) for i, (key, n) in enumerate(trace)]
            allocator = CachingAllocatorModel()
            allocator.run([*calls[:first], *bucket_calls(before)])
            start = len(allocator.trace)
            allocator.run(calls[first:step_at])
            allocator.finish_steps(start, epilogue, allocator.held_since(start), micro_steps, calls[step_at:])
            out = self.composed[full_key] = replace(act, cuda_allocated=allocator.peak_allocated,
                                                    cuda_reserved=allocator.reserved_beside_strays(),
                                                    cuda_requested=allocator.peak_requested)
        else:
            recorded = self._recorded(plan, mb)
            if recorded.timeline is None:
                return None
            out = self.composed[full_key] = self._compose(recorded, plan.activation_checkpointing, epilogue,
                                                          micro_steps, before)
        return None if isinstance(out, StepFailed) else out


def _buckets(plan: Plan, shard: StepMeasurement) -> tuple[int, ...]:
    """The blocks DDP's gradient buckets take before the step, where ``plan``'s sharding keeps them (DDP, ZeRO-1):
    its sharding step's communication bytes, in buckets of ``bucket_cap_mb``. A row's forward/backward is recorded in
    one process, without them; each stays for the whole run in a segment its activations share (a tiny ViT at 2 ranks,
    `bf16 fused mb16x1`: 18 MiB reserved under its own fake step without them)."""
    if plan.sharding not in ("none", "zero1"):
        return ()
    return ddp_buckets(shard.forward_backward.breakdown.get("communication", 0))
