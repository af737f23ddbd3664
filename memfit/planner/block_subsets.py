"""The planner's own checkpointing choice, ``ac:firstN``: where a plan fits only with checkpointing, the fewest
first blocks that make it fit."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from memfit.planner.results import AUTO_FIT_MARGIN, PlanResult
from memfit.planner.runs import StepFailed
from memfit.planner.space import Plan


class Composer(Protocol):
    """What composes a plan's row (memfit.planner.composer's ``Composer``); ``recorded``: from a recorded
    forward/backward, so checkpointing choices compose rather than run."""

    recorded: bool

    def __call__(self, plan: Plan) -> PlanResult: ...


def block_subsets(results: list[PlanResult], blocks: int, budget: int, compose: Composer) -> list[PlanResult]:
    """The planner's own checkpointing choice: where a plan does not fit without checkpointing but does
    with every block checkpointed, the fewest first blocks (``ac:firstN``) that fit. Composed like any
    choice from the recorded forward/backward (a bisection over N: the peak falls as blocks are added);
    where choices are run instead, peak and time are interpolated by the share of blocks, which errs high
    on pyramids (Swin, ResNet), whose first blocks hold the largest activations. A recommended subset is
    re-run whole like any row."""
    limit = budget * (1 - AUTO_FIT_MARGIN)
    by_rest = {replace(r.plan, activation_checkpointing="none", configured=False): r for r in results
               if r.plan.activation_checkpointing == "blocks"}
    out = []
    for r in results:
        full = by_rest.get(replace(r.plan, configured=False)) if r.plan.activation_checkpointing == "none" else None
        if full is None or blocks < 2 or r.peak_bytes <= limit or full.peak_bytes > limit:
            continue
        subset = _fewest_blocks(r.plan, blocks, limit, compose) if compose.recorded else _interpolated(r, full, blocks,
                                                                                                        limit)
        if subset is not None:
            out.append(subset)
    return out


def _fewest_blocks(plan: Plan, blocks: int, limit: float, compose: Composer) -> PlanResult | None:
    best, lo, hi = None, 1, blocks - 1
    while lo <= hi:
        n = (lo + hi) // 2
        try:
            r = compose(replace(plan, activation_checkpointing=f"first{n}", configured=False))
        except StepFailed:
            return best
        if r.peak_bytes <= limit:
            best, hi = r, n - 1
        else:
            lo = n + 1
    return best


def _interpolated(r: PlanResult, full: PlanResult, blocks: int, limit: float) -> PlanResult | None:
    per_block = (r.peak_bytes - full.peak_bytes) / blocks
    n = min(blocks, max(1, int((r.peak_bytes - limit) / per_block) + 1)) if per_block > 0 else blocks
    if n >= blocks:
        return None
    share = n / blocks
    peak = int(r.peak_bytes - share * (r.peak_bytes - full.peak_bytes))
    breakdown = {k: int(v + share * (full.breakdown.get(k, 0) - v)) for k, v in r.breakdown.items()}
    return PlanResult(replace(r.plan, activation_checkpointing=f"first{n}", configured=False), peak, breakdown,
                      int(r.allocated + share * (full.allocated - r.allocated)),
                      int(r.reserved + share * (full.reserved - r.reserved)),
                      r.seconds + share * (full.seconds - r.seconds))
