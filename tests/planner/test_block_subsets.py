"""``ac:firstN`` where checkpointing choices are run rather than composed (a model with its own checkpointing
switch): the fewest first blocks that fit, its peak and time interpolated between no checkpointing and every
block by the share of blocks. (The composed bisection is tests/planner/test_compose_all.py's.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.planner.block_subsets import _fewest_blocks, block_subsets
from memfit.planner.cost import StepTime
from memfit.planner.devices import GiB
from memfit.planner.results import PlanResult
from memfit.planner.runs import StepFailed
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


class Curve:
    """A composer whose ``firstN`` rows peak at ``base`` plus the activations of the blocks left unchecked."""

    recorded, runs = True, None

    def __init__(self, acts: list[float], base: float = 3.0, fails_at: int | None = None) -> None:
        self.acts, self.base, self.fails_at, self.calls = acts, base, fails_at, []

    def peak(self, n: int) -> int:
        return int((self.base + sum(self.acts[n:])) * GiB)

    def __call__(self, plan: Plan) -> PlanResult:
        n = int(plan.activation_checkpointing.removeprefix("first"))
        self.calls.append(n)
        if n == self.fails_at:
            raise StepFailed("composition failed")
        return PlanResult(plan, self.peak(n), {}, self.peak(n), self.peak(n), 1.0)


@pytest.mark.parametrize("acts", [[1.0] * 24, [8.0] * 2 + [4.0] * 2 + [2.0] * 18 + [1.0] * 2, [5.0, 0.1, 3.0, 2.0]])
def test_the_fewest_blocks_are_the_smallest_n_that_fits(acts):
    """Against every N, for every limit the search is for (over the peak without checkpointing, within the peak with
    every block): the smallest N whose peak fits, found in a few compositions."""
    blocks = len(acts)
    curve = Curve(acts)
    for n_limit in range(1, blocks + 1):
        limit = curve.peak(n_limit) + 1  # N = n_limit is the first within it (or an earlier one of equal peak)
        want = next(n for n in range(blocks + 1) if curve.peak(n) <= limit)
        curve.calls.clear()
        r = _fewest_blocks(Plan("bf16"), blocks, limit, curve, (curve.peak(0), curve.peak(blocks)))
        got = int(r.plan.activation_checkpointing.removeprefix("first")) if r else None
        assert got == (want if 0 < want < blocks else None), (n_limit, curve.calls)
        assert len(curve.calls) <= blocks.bit_length() + 3


def test_a_composition_that_fails_ends_the_search_with_what_was_found():
    curve = Curve([1.0] * 16, fails_at=None)
    limit = curve.peak(5)
    curve.fails_at = 4  # the search probes 5 (fits), then 4
    r = _fewest_blocks(Plan("bf16"), 16, limit, curve, (curve.peak(0), curve.peak(16)))
    assert curve.calls[-1] == 4 and r.plan.activation_checkpointing == "first5"
