"""``ac:firstN`` where checkpointing choices are run rather than composed (a model with its own checkpointing
switch): the fewest first blocks that fit, its peak and time interpolated between no checkpointing and every
block by the share of blocks. (The composed bisection is tests/planner/test_compose_all.py's.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.planner.block_subsets import block_subsets
from memfit.planner.cost import StepTime
from memfit.planner.devices import GiB
from memfit.planner.results import PlanResult
from memfit.planner.space import Plan


def row(ac: str, peak_gib: float, time: StepTime, configured: bool = False) -> PlanResult:
    peak = int(peak_gib * GiB)
    return PlanResult(Plan("bf16", ac, configured=configured), peak, {"activations": peak}, peak, peak, time.seconds,
                      time=time)


RUN = SimpleNamespace(recorded=False, runs=None)  # choices run, not composed: nothing to compose with


def test_the_fewest_first_blocks_that_fit_interpolated_by_their_share():
    none = row("none", 10, StepTime(kernels=1.0, host=0.5), configured=True)
    every = row("blocks", 2, StepTime(kernels=1.4, host=0.9))
    # 8 blocks: each takes 1 GiB off; the budget's 8 GiB less the 5% kept free is 7.6 GiB: 3 blocks (7 GiB)
    (r,) = block_subsets([none, every], blocks=8, budget=8 * GiB, compose=RUN)
    assert r.plan.activation_checkpointing == "first3" and not r.plan.configured
    assert r.peak_bytes == int(7 * GiB) and r.breakdown == {"activations": int(7 * GiB)}
    assert (r.allocated, r.reserved) == (int(7 * GiB), int(7 * GiB))
    assert (r.time.kernels, r.time.host) == (pytest.approx(1.15), pytest.approx(0.65))  # 3/8 of the way
    assert r.seconds == pytest.approx(1.15)


def test_no_subset_where_none_is_needed_or_none_fits():
    t = StepTime(kernels=1.0, host=0.5)
    assert block_subsets([row("none", 7, t), row("blocks", 2, t)], 8, 8 * GiB, RUN) == []  # fits without
    assert block_subsets([row("none", 10, t), row("blocks", 7.7, t)], 8, 8 * GiB, RUN) == []  # not even with all
    assert block_subsets([row("none", 10, t), row("blocks", 2, t)], 1, 8 * GiB, RUN) == []  # one block: 'blocks'
    # all 8 would be needed (each takes 0.31 GiB off): that is 'blocks' itself
    assert block_subsets([row("none", 10, t), row("blocks", 7.5, t)], 8, 8 * GiB, RUN) == []
