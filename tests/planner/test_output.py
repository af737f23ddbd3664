"""The planner's units and what it says: sizes parsed with their unit (GiB binary, GB decimal, none
refused), printed in GiB/MiB; "no plan fits" as one line and exit status 3; the chart, which names the
GPU, ranks and budget, tells fitting plans from the others and names the Pareto front's plans, and is
not drawn for one plan. Predictions are made up here (no fake steps) except in the last test."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from memfit.cli import main
from memfit.errors import ConfigError
from memfit.planner import predict as predict_module
from memfit.planner.chart import MAX_LABELS, labelled, pareto, plan_figure, write_png
from memfit.planner.commands import NO_PLAN_FITS
from memfit.planner.devices import GiB, MiB, gpu, parse_bytes
from memfit.planner.inputs import PlannedInput
from memfit.planner.report import size, summary, verdict
from memfit.planner.results import PlanResult, Prediction
from memfit.planner.space import Plan


def _prediction(points: list[tuple[Plan, float, float]], budget: float, world: int = 8) -> Prediction:
    """A made-up prediction on 4090s: (plan, relative time, peak in GiB) each, fits and recommendation
    as :func:`memfit.planner.predict.predict` decides them."""
    results = [PlanResult(plan, int(peak * GiB), {}, int(peak * GiB), int(peak * GiB), t, rel_step_time=t,
                          fits=peak * GiB <= budget * GiB) for plan, t, peak in sorted(points, key=lambda p: p[1])]
    fitting = [i for i, r in enumerate(results) if r.peak_bytes <= 0.95 * budget * GiB]
    return Prediction(gpu("4090"), world, int(budget * GiB), results, fitting[0] if fitting else None,
                      input=PlannedInput((32, 3, 224, 224), None, "derived"))


def _plan(ac: str = "none", sharding: str = "none", mb: int = 32, configured: bool = False) -> Plan:
    return Plan(precision="bf16", activation_checkpointing=ac, sharding=sharding, micro_batch=mb,
                accumulative_counts=32 // mb, configured=configured)


# A Pareto front of ten fitting plans, two plans they beat, two that do not fit and one 30x slower.
FRONT = [(_plan(ac, sh, mb), t, peak) for (ac, sh, mb), t, peak in [
    (("none", "zero1", 32), 0.9, 10.4), (("none", "fsdp", 32), 0.95, 10.0), (("every2", "zero1", 32), 1.1, 8.1),
    (("every2", "fsdp", 32), 1.15, 7.5), (("blocks", "zero1", 32), 1.3, 5.4), (("blocks", "fsdp", 32), 1.35, 4.9),
    (("blocks", "fsdp", 16), 2.2, 4.0), (("blocks", "fsdp", 8), 3.0, 3.7), (("stages", "fsdp", 8), 3.2, 3.6),
    (("selective", "fsdp", 8), 3.4, 3.5)]]
OTHERS = [(_plan(configured=True), 1.0, 12.0), (_plan("every2", mb=16), 2.0, 9.0), (_plan(mb=16), 1.2, 30.0),
          (_plan("stages"), 1.05, 26.0), (_plan("selective", "zero2", 1), 30.0, 3.9)]


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * GiB), ("24gib", 24 * GiB), ("500MiB", 500 * MiB), ("1.5TiB", int(1.5 * 2**40)),
    ("100KiB", 100 * 1024), ("24GB", 24 * 10**9), ("24gb", 24 * 10**9), ("500MB", 500 * 10**6), ("4096B", 4096),
    (" 2 GiB ", 2 * GiB)])
def test_sizes_are_parsed_with_their_unit(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("value,message", [
    ("24", "--budget='24': a size needs a unit: 24GiB (2^30 bytes) or 24GB (10^9 bytes)"),
    ("24G", "--budget='24G': 'G' is not a unit: 24GiB (2^30 bytes) or 24GB (10^9 bytes)"),
    (24 * GiB, f"--budget={24 * GiB}: a size needs a unit; write it as a string: '{24 * GiB}B' (bytes)"),
    ("0GiB", "--budget='0GiB': a size must be more than 0 bytes"),
    ("lots", "--budget='lots': not a size")])
def test_a_size_without_a_unit_is_refused_naming_the_units(value, message):
    with pytest.raises(ConfigError) as info:
        parse_bytes(value)
    assert str(info.value).startswith(message), str(info.value)


def test_sizes_print_in_binary_units():
    assert size(24 * GiB) == "24.00 GiB" and size(24 * 10**9) == "22.35 GiB" and size(412 * MiB) == "412.0 MiB"
    # a tiny budget is not "0.0 MiB"
    assert size(MiB // 10) == "102.4 KiB" and size(MiB // 5) == "0.2 MiB" and size(1024) == "1.0 KiB"
    pred = _prediction(FRONT + OTHERS, 24)
    assert verdict(pred) == ("recommended (8 x 4090, budget 24.00 GiB per rank): bf16 zero1 mb32x1, peak 10.40 GiB, "
                             "0.90x the configured step time")


def test_no_plan_fits_names_the_budget_the_smallest_peak_and_what_to_try():
    pred = _prediction(FRONT + OTHERS, 3)
    assert pred.recommended is None
    assert summary(pred) == verdict(pred) == (
        "no plan fits (8 x 4090, budget 3.00 GiB per rank); the smallest is 'bf16 ac:selective fsdp mb8x4', "
        "predicted peak 3.50 GiB; try a bigger --budget, more GPUs (--gpus, --nodes), or --as-is to see the "
        "configured plan")
    assert "within the budget but not its margin" in verdict(_prediction(FRONT, 3.6))  # under it, not the margin
    alone = _prediction(OTHERS[:1], 3, world=1)
    assert verdict(alone).startswith("the configured plan does not fit (1 x 4090, budget 3.00 GiB per rank): "
                                     "'bf16 mb32x1', predicted peak 12.00 GiB; ")


def test_memfit_plan_exits_3_when_no_plan_fits(tiny_config, tmp_path, monkeypatch):
    made_up = _prediction(FRONT + OTHERS, 3)

    def fake_predict(cfg, *, device, world_size, budget, **_):
        assert (device.name, world_size, budget) == ("4090", 8, 3 * GiB)
        return made_up

    monkeypatch.setattr(predict_module, "predict", fake_predict)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", str(tiny_config(tmp_path)), "--gpu", "4090", "--gpus", "8", "--budget", "3GiB",
                     "--png", str(tmp_path / "plan.png"), "--json", str(tmp_path / "plan.json")])
    assert code == NO_PLAN_FITS == 3
    assert err.getvalue().splitlines() == [f"memfit: {verdict(made_up)}"]
    assert "recommended" not in out.getvalue()  # the table, the chart and the JSON are still written
    assert f"wrote {tmp_path / 'plan.png'}" in out.getvalue()
    assert json.loads((tmp_path / "plan.json").read_text())["recommended"] is None


def test_the_chart_names_the_target_and_the_pareto_plans():
    import matplotlib.pyplot as plt

    pred = _prediction(FRONT + OTHERS, 24)
    fig = plan_figure(pred)
    try:
        ax, side = fig.axes
        assert fig._suptitle.get_text() == "memfit plan: 8 x 4090 (24.00 GiB), budget 24.00 GiB per rank"
        assert ax.get_xscale() == "log" and ax.get_ylabel() == "predicted peak per rank (GiB)"
        labels = [t.get_text() for t in side.get_legend().get_texts()]
        assert {"fits (13)", "does not fit (2)", "budget 24.00 GiB", "recommended"} <= set(labels), labels
        assert "1 slower plan (30x), at the right edge" in labels, labels
        key = "\n".join(t.get_text() for t in side.texts)
        named = [r.plan.name for r in pred.results if r.plan.name in key]
        assert len(named) == MAX_LABELS  # ten on the front: eight named, its ends and the recommended among them
        front = [p.name for p, _, _ in FRONT]
        assert set(named) <= set(front) and {front[0], front[-1]} <= set(named)
        assert f"{front[0]}  (recommended)" in key and " 0.90x   10.40 GiB  " in key
        numbers = [t.get_text() for t in ax.texts]
        assert numbers == [str(n) for n in range(1, MAX_LABELS + 1)]  # each named plan numbered on the chart
    finally:
        plt.close(fig)


def test_pareto_and_the_labelled_points():
    points = [(1.0, 5.0), (2.0, 3.0), (1.5, 6.0), (3.0, 3.0), (0.5, 9.0)]
    assert pareto(points) == [4, 0, 1]
    front = list(range(20))
    picked = labelled(front, {7})
    assert len(picked) == MAX_LABELS and {0, 7, 19} <= set(picked) and picked == sorted(picked)
    assert labelled([3, 1], {1}) == [3, 1]


def test_one_plan_gets_no_chart(tmp_path):
    pred = _prediction(OTHERS[:1], 24, world=1)
    assert plan_figure(pred) is None
    assert write_png(pred, tmp_path / "plan.png") is None and not (tmp_path / "plan.png").exists()


def test_the_configured_plan_alone_over_the_budget_exits_3(tiny_config, tmp_path):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", str(tiny_config(tmp_path)), "--device", "cpu", "--as-is", "--budget", "100KiB"])
    assert code == 3, err.getvalue()
    line, = err.getvalue().splitlines()
    assert line.startswith("memfit: the configured plan does not fit (1 x cpu (")
    assert "budget 100.0 KiB per rank" in line
    assert "no chart: one plan has nothing to compare" in out.getvalue()
