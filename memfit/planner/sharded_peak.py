"""A composed row's peak under a sharding (ZeRO-2, FSDP): its own forward/backward beside what the sharding's step
held at each of the same sync points (:mod:`memfit.planner.sync_points`) beyond the single-device reference step."""

from __future__ import annotations

from typing import Any

from memfit.planner.sync_points import SyncProfile


def sharded_peak(shard: SyncProfile | None, ref: SyncProfile | None, row: SyncProfile | None) -> int | None:
    """The peak of a row's forward/backward under a sharding, in ``shard``'s terms, or None where the three do
    not have the same points. ``row``: the row's composed single-device forward/backward; ``shard``: the
    sharding's step of the reference activations; ``ref``: those activations on a single device.

    Between two points the row holds its own peak plus what ``shard`` held beyond ``ref`` at either end (the
    sharding's hooks run at the points: which end, is not known). Where the sharding's step rises higher than
    that, its own buffers peaked in the stretch (an all-gather's, a reduce-scatter's): at its peak, the
    activations are as they were at the end of the stretch nearer to it in the sharding's operators (its hooks
    run there), so the row holds its own bytes there plus the sharding's step's peak less the reference's."""
    if shard is None or ref is None or row is None or len(shard.late) != len(shard.peaks) or row.kinds != ref.kinds:
        return None
    order = _order(shard, ref)
    if order is None:
        return None
    n = len(order)
    inv = [0] * n  # shard's points -> ref's
    for j, i in enumerate(order):
        inv[i] = j
    w_ends, w_peaks = _moved(row, inv)
    s_ends, r_ends = (shard.start, *shard.at), (ref.start, *ref.at)
    # Whether the same points came before each end in both. A sharding may make backward reach parallel branches
    # in another order (FSDP2's hooks on DINO's do: 366 of its 1790 points): the row runs in the sharding's order;
    # at a point moved the sharding's step holds other activations than the reference's, and the sharding's bytes
    # are its own ones (``shard.own``; where the order is the same, they equal the totals' difference to the byte).
    settled, highest = [True], -1
    for k, j in enumerate(inv):
        highest = max(highest, j)
        settled.append(j == k == highest)
    base, own = shard.start - ref.start, (0, *shard.own)
    extras = [s_ends[k] - r_ends[k] if settled[k] else base + own[k] for k in range(n + 1)]
    peak = 0
    for k in range(n + 1):
        ends = (k, min(k + 1, n))
        extra = max(extras[e] for e in ends)
        peak = max(peak, w_peaks[k] + extra)
        e = ends[shard.late[k]]
        if settled[ends[0]] and settled[ends[1]]:  # the same stretch in both
            if shard.peaks[k] > ref.peaks[k] + extra:
                peak = max(peak, w_ends[e] + shard.peaks[k] - r_ends[e])
        elif base + shard.own_peaks[k] > extra:
            peak = max(peak, w_ends[e] + base + shard.own_peaks[k])
    return peak


def _moved(p: SyncProfile, inv: list[int]) -> tuple[list[int], list[int]]:
    """``p``'s totals at the ends of the stretches and its peaks between them in another order of its points
    (``inv``: the index in ``p`` of each point in that order): each stretch moved with the point it ends at, its
    rise and its change the same."""
    ends, peaks = (p.start, *p.at), p.peaks
    if inv == list(range(len(inv))):
        return list(ends), list(peaks)
    out_ends, out_peaks = [p.start], []
    for j in (*inv, len(inv)):
        out_peaks.append(out_ends[-1] + peaks[j] - ends[j])
        if j < len(inv):
            out_ends.append(out_ends[-1] + ends[j + 1] - ends[j])
    return out_ends, out_peaks


def _order(shard: SyncProfile, ref: SyncProfile) -> list[int] | None:
    """Where each of ``ref``'s points is among ``shard``'s: by identity where both have them and ``shard`` counted
    its own bytes, else in order; None where the two do not have the same points."""
    paired = bool(shard.ids and ref.ids and shard.own)
    if shard.kinds == ref.kinds and (not paired or shard.ids == ref.ids):
        return list(range(len(ref.kinds)))
    if not paired:
        return None
    a, b = _relative(shard.ids), _relative(ref.ids)
    if a == b:
        return list(range(len(ref.kinds))) if shard.kinds == ref.kinds else None
    where = {ident: i for i, ident in enumerate(a)}
    if len(where) != len(a) or len(b) != len(a) or set(b) != where.keys():
        return None
    return [where[ident] for ident in b]


def _relative(ids: tuple[Any, ...]) -> list[Any]:
    """Point identities with each module's calls counted from its first in the profile (a later micro-step's)."""
    first: dict[int, int] = {}
    out = []
    for ident in ids:
        if len(ident) == 4:
            kind, place, call, j = ident
            ident = (kind, place, call - first.setdefault(place, call), j)
        out.append(ident)
    return out
