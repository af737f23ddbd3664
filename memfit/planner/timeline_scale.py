"""A recorded forward/backward at another micro-batch, from two recordings of it at two micro-batches.

A vision model runs the same operators in the same order at every micro-batch: only the bytes of the tensors
that carry the batch, and the FLOPs and bytes written of the operators over them, change, each linearly in
the batch (a tensor of shape ``(B, ...)`` holds ``B`` times a sample's bytes; parameters hold the same). Two
recordings with the same events (:mod:`memfit.planner.timeline`) then give every size at any micro-batch on
the line through them, exact where the model is linear in the batch, so a row at micro-batch 4 composes its
checkpointing and replays the simulated CUDA allocator on its own sizes, not on a larger recording's.

A reduction's kernel scratch is not linear in its input (the split depends on it): the recordings keep each
reduction's arguments (:func:`memfit.planner.kernel_scratch.cuda_scratch`), whose shape and strides are, and
its blocks are worked out again at the new micro-batch. Recordings whose events differ other than in sizes
(a data-dependent branch) are not scaled: :func:`at_micro_batch` says None and the caller records that
micro-batch itself; frees of one moment that came in another order are taken from the smaller recording.
"""

from __future__ import annotations

from dataclasses import replace

from memfit.planner.fake import StepMeasurement
from memfit.planner.timeline import ALLOC, FREE, OP, SCRATCH, Timeline


def scaled_recording(low: StepMeasurement, high: StepMeasurement, mbs: tuple[int, int],
                     mb: int) -> StepMeasurement | None:
    """A recorded forward/backward (its timeline and FLOPs) at micro-batch ``mb`` from ``low`` and ``high``,
    recorded at ``mbs``; None where they cannot be scaled (:func:`at_micro_batch`)."""
    timeline = at_micro_batch(low.timeline, high.timeline, mbs, mb)
    if timeline is None:
        return None
    line = _Line(*mbs, mb)
    flops = [line(getattr(low, f), getattr(high, f)) for f in ("flops", "conv_flops", "attn_flops", "written")]
    if None in flops:
        return None
    return replace(low, timeline=timeline, flops=flops[0], conv_flops=flops[1], attn_flops=flops[2],
                   written=flops[3])


def at_micro_batch(low: Timeline, high: Timeline, mbs: tuple[int, int], mb: int) -> Timeline | None:
    """The timeline at micro-batch ``mb`` from ``low`` and ``high``, recorded at ``mbs`` (the smaller first);
    None where their events differ other than in sizes or a size would not be positive."""
    if len(low.events) != len(high.events) or low.step_at != high.step_at or not _same_prefix(low, high):
        return None
    line = _Line(*mbs, mb)
    events = []
    for a, b in zip(low.events, high.events):
        kind = a[0]
        if kind != b[0]:
            return None
        if kind == ALLOC:
            if a[1] != b[1] or a[3] != b[3]:
                return None
            n = line(a[2], b[2])
            if n is None:
                return None
            events.append((ALLOC, a[1], n, a[3]))
        elif kind == OP:
            flops, written = line(a[1], b[1]), line(a[2], b[2])
            if flops is None or written is None or a[3] != b[3]:
                return None
            events.append((OP, flops, written, a[3]))
        elif kind == SCRATCH:
            sizes = _scratch(a, b, line)
            if sizes is None:
                return None
            events.append((SCRATCH, tuple(sizes), None))
        elif a == b or kind == FREE:  # frees of one moment may come in another order; the uids are the same
            events.append(a)
        else:
            return None
    if sorted(e[1] for e in low.events if e[0] == FREE) != sorted(e[1] for e in high.events if e[0] == FREE):
        return None
    prefix = None
    if low.prefix is not None and high.prefix is not None:
        sizes = [n if n is None else line(n, nb) for (_, n), (_, nb) in zip(low.prefix[0], high.prefix[0])]
        if any(n is None and na is not None for n, (_, na) in zip(sizes, low.prefix[0])):
            return None  # a size not on a line (None here would read as a free)
        prefix = ([(key, n) for (key, _), n in zip(low.prefix[0], sizes)], dict(low.prefix[1]))
    start = line(low.start, high.start)
    if start is None:
        return None
    return Timeline(events, start, prefix, dict(low.streams), list(low.calls), list(low.parents), low.step_at)


class _Line:
    """A quantity at ``mb`` on the line through its values at ``lo`` and ``hi`` (rounded to whole units);
    None where that is negative (not linear in the batch)."""

    def __init__(self, lo: int, hi: int, mb: int) -> None:
        self.lo, self.hi, self.mb = lo, hi, mb

    def __call__(self, a: int, b: int) -> int | None:
        if a == b:
            return a
        num = a * (self.hi - self.mb) + b * (self.mb - self.lo)
        out = (2 * num + (self.hi - self.lo)) // (2 * (self.hi - self.lo))
        return out if out >= 0 else None


def _same_prefix(low: Timeline, high: Timeline) -> bool:
    if (low.prefix is None) != (high.prefix is None):
        return False
    if low.prefix is None:
        return True
    (ta, sa), (tb, sb) = low.prefix, high.prefix
    return len(ta) == len(tb) and sa == sb and all((na is None) == (nb is None) for (_, na), (_, nb) in zip(ta, tb))


def _scratch(a: tuple, b: tuple, line: _Line) -> tuple[int, ...] | None:
    """A reduction's or a norm's scratch blocks at the line's micro-batch, from its arguments at the two
    recordings'; another operator's (a copy of its input: ``torch.roll``'s) on the line through their sizes."""
    spec_a, spec_b = a[2], b[2]
    if spec_a is None and spec_b is None:
        if len(a[1]) != len(b[1]):
            return None
        sizes = tuple(line(x, y) for x, y in zip(a[1], b[1]))
        return None if None in sizes else sizes
    if spec_a is None or spec_b is None:
        return None
    # (kernel_scratch.Blocks' spec) what scales with the batch on the line, the rest the same
    (kind, linear_a, constant), (kind_b, linear_b, constant_b) = spec_a, spec_b
    if kind is not kind_b or constant != constant_b or len(linear_a) != len(linear_b):
        return None
    linear = tuple(line(x, y) for x, y in zip(linear_a, linear_b))
    return None if None in linear else kind.at(linear, constant)
