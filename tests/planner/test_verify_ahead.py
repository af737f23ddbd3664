"""The recommendation's verification runs beside those of the plans that would follow it, one per worker: when
the first is found over the budget (DINO's), the next one's fake step has already run."""

from __future__ import annotations

import pytest

from memfit.planner import predict
from memfit.planner.devices import GiB
from memfit.planner.results import PlanResult
from memfit.planner.runs import StepFailed
from memfit.planner.space import Plan


class StubRuns:
    def __init__(self, failed: tuple[Plan, ...] = (), forked: bool = True) -> None:
        self.collecting, self.queued, self.executed, self.failed = False, [], 0, failed
        self.forked = forked  # steps run in worker processes

    def run(self, key, plan, full, steps=2, **kwargs):
        assert self.collecting and key == ("verify", plan) and full and steps == 1
        if plan in self.failed:
            raise StepFailed("cached: fails")
        self.queued.append(plan)

    def execute(self) -> None:
        self.executed += 1


def row(precision: str, seconds: float, peak_gib: float, source: str = "composed") -> PlanResult:
    peak = int(peak_gib * GiB)
    return PlanResult(Plan(precision), peak, {}, peak, peak, seconds, source)


ROWS = [row("fp32", 1.0, 5), row("bf16", 0.5, 7), row("fp16", 0.6, 7), row("fp32", 0.7, 6, "measured")]


@pytest.mark.parametrize("workers, queued", [(1, []), (2, ["bf16", "fp16"]), (4, ["bf16", "fp16"])])
def test_the_recommended_plan_and_those_after_it_verified_at_once(monkeypatch, workers, queued):
    monkeypatch.setattr(predict, "workers", lambda: workers)
    runs = StubRuns()
    # budget 8 GiB (7.6 with the margin): bf16 is recommended, fp16 follows it, then the measured fp32 row (its own
    # fake step already, where verification stops)
    predict._verify_ahead(runs, ROWS, 8 * GiB, 1)
    assert [p.precision for p in runs.queued] == queued and runs.executed == (1 if queued else 0)
    assert not runs.collecting


def test_nothing_ahead_of_a_lone_candidate(monkeypatch):
    monkeypatch.setattr(predict, "workers", lambda: 2)
    runs = StubRuns()
    predict._verify_ahead(runs, ROWS, int(5.3 * GiB), 0)  # only fp32 at 5 GiB fits
    assert runs.queued == [] and runs.executed == 0
    predict._verify_ahead(runs, ROWS, 8 * GiB, None)  # nothing recommended
    assert runs.executed == 0


def test_a_step_already_failed_is_left_to_the_loop(monkeypatch):
    monkeypatch.setattr(predict, "workers", lambda: 2)
    runs = StubRuns(failed=(Plan("bf16"),))
    predict._verify_ahead(runs, ROWS, 8 * GiB, 1)
    assert [p.precision for p in runs.queued] == ["fp16"] and runs.executed == 1 and not runs.collecting


def test_not_where_steps_run_one_after_the_other(monkeypatch):
    """Without worker processes (no fork, or a backward ran in this process) the next plan's verification would add
    its whole time when the first fits."""
    monkeypatch.setattr(predict, "workers", lambda: 2)
    runs = StubRuns(forked=False)
    predict._verify_ahead(runs, ROWS, 8 * GiB, 1)
    assert runs.queued == [] and runs.executed == 0
