"""The planner's own checkpointing choice, ``ac:firstN``: where a plan fits only with checkpointing, the fewest
first blocks that make it fit."""

from __future__ import annotations

import math
from dataclasses import astuple, replace
from typing import Protocol

from memfit.planner.compose_all import groups, in_processes
from memfit.planner.cost import StepTime
from memfit.planner.results import AUTO_FIT_MARGIN, PlanResult
from memfit.planner.runs import Runs, StepFailed
from memfit.planner.space import Plan


class Composer(Protocol):
    """What composes a plan's row (memfit.planner.composer's ``Composer``); ``recorded``: from a recorded
    forward/backward, so checkpointing choices compose rather than run."""

    recorded: bool
    runs: Runs

    def __call__(self, plan: Plan) -> PlanResult: ...


def block_subsets(results: list[PlanResult], blocks: int, budget: int, compose: Composer, processes: int = 1
                  ) -> list[PlanResult]:
    """The planner's own checkpointing choice: where a plan does not fit without checkpointing but does
    with every block checkpointed, the fewest first blocks (``ac:firstN``) that fit. Composed like any
    choice from the recorded forward/backward (a search over N, :func:`_fewest_blocks`: the peak falls as blocks
    are added; the plans' searches in up to ``processes`` processes, :func:`~memfit.planner.compose_all.in_processes`);
    where choices are run instead, peak and time are interpolated by the share of blocks, which errs high
    on pyramids (Swin, ResNet), whose first blocks hold the largest activations. A recommended subset is
    re-run whole like any row."""
    limit = budget * (1 - AUTO_FIT_MARGIN)
    by_rest = {replace(r.plan, activation_checkpointing="none", configured=False): r for r in results
               if r.plan.activation_checkpointing == "blocks"}
    todo = []
    for r in results:
        full = by_rest.get(replace(r.plan, configured=False)) if r.plan.activation_checkpointing == "none" else None
        if full is not None and blocks >= 2 and r.peak_bytes > limit and full.peak_bytes <= limit:
            todo.append((r, full))
    if not compose.recorded:
        return [s for r, full in todo if (s := _interpolated(r, full, blocks, limit)) is not None]
    plans = [r.plan for r, _ in todo]
    peaks = {r.plan: (r.peak_bytes, full.peak_bytes) for r, full in todo}
    found = in_processes(groups(plans), lambda p: _fewest_blocks(p, blocks, limit, compose, peaks[p]), processes,
                         compose.runs)
    return [found[i] for i in range(len(plans)) if found[i] is not None]


def _fewest_blocks(plan: Plan, blocks: int, limit: float, compose: Composer, peaks: tuple[int, int]
                   ) -> PlanResult | None:
    """The smallest N in 1..blocks-1 whose ``firstN`` row fits ``limit``, given the peaks without checkpointing and
    with every block (``peaks``): a secant search, each probe where the line through the last two probes' peaks
    meets the limit, kept between the largest N known over it and the smallest known within (and halving that
    span where two probes did not). The same N as bisection where the peak falls with N, in about a quarter fewer
    compositions on pyramids, whose first blocks hold the most (3.6 against 4.6 probes over 2,000 made-up ones)."""
    lo, hi = 0, blocks
    points, spans, best = [(0, peaks[0]), (blocks, peaks[1])], [blocks], None
    while hi - lo > 1:
        (a, peak_a), (b, peak_b) = points[-2:]
        if peak_a == peak_b or (len(spans) >= 3 and spans[-1] > spans[-3] / 2):
            n = (lo + hi) // 2
        else:
            n = math.ceil(a + (peak_a - limit) / (peak_a - peak_b) * (b - a))
        n = min(hi - 1, max(lo + 1, n))
        try:
            r = compose(replace(plan, activation_checkpointing=f"first{n}", configured=False))
        except StepFailed:
            return best
        points.append((n, r.peak_bytes))
        if r.peak_bytes <= limit:
            best, hi = r, n
        else:
            lo = n
        spans.append(hi - lo)
    return best


def _interpolated(r: PlanResult, full: PlanResult, blocks: int, limit: float) -> PlanResult | None:
    per_block = (r.peak_bytes - full.peak_bytes) / blocks
    n = min(blocks, max(1, int((r.peak_bytes - limit) / per_block) + 1)) if per_block > 0 else blocks
    if n >= blocks:
        return None
    share = n / blocks
    peak = int(r.peak_bytes - share * (r.peak_bytes - full.peak_bytes))
    breakdown = {k: int(v + share * (full.breakdown.get(k, 0) - v)) for k, v in r.breakdown.items()}
    time = _between(r.time, full.time, share)
    return PlanResult(replace(r.plan, activation_checkpointing=f"first{n}", configured=False), peak, breakdown,
                      int(r.allocated + share * (full.allocated - r.allocated)),
                      int(r.reserved + share * (full.reserved - r.reserved)),
                      time.seconds if time else r.seconds + share * (full.seconds - r.seconds), time=time)


def _between(a: StepTime | None, b: StepTime | None, share: float) -> StepTime | None:
    """Each part of ``a`` moved ``share`` of the way to ``b``'s."""
    if a is None or b is None:
        return None
    return StepTime(*(x + share * (y - x) for x, y in zip(astuple(a)[:4], astuple(b)[:4])), cuda=a.cuda)
