"""Auto-fit picks the fastest predicted plan within the budget (less its 5% margin), that plan really
fits, and a budget nothing fits is refused in one line naming the closest plan.

The tiny config (conftest.py) is planned three times: by ``memfit train --auto-fit 30MiB`` (every
plan fits: the prediction in its auto_fit.json gives the plans' peaks), by ``apply_auto_fit`` at a
budget between the smallest peak and the fastest plan's (the fastest no longer fits), and by
``memfit train`` with a budget below every plan.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from memfit.cli import main
from memfit.config import Config
from memfit.planner.autofit import apply_auto_fit
from memfit.planner.bench import measure_plan
from memfit.planner.fake import build_meta_model
from memfit.planner.predict import AUTO_FIT_MARGIN
from memfit.planner.space import ModelFacts, Plan


@pytest.fixture(scope="module")
def trained(tiny_config, tmp_path_factory):
    """``memfit train CFG --auto-fit 30MiB``: (exit status, config dict, auto_fit.json, log text)."""
    import logging

    path = tiny_config(tmp_path_factory.mktemp("autofit_train"))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("memfit")
    logger.addHandler(handler)
    try:
        code = main(["train", str(path), "--auto-fit", "30MiB"])
    finally:
        logger.removeHandler(handler)
    cfg = Config.fromfile(str(path)).to_dict()
    doc = json.loads((path.parent / "work" / "auto_fit.json").read_text())
    return code, cfg, doc, "\n".join(records)


def _fastest_fitting(plans: list[dict], budget: int) -> dict:
    limit = budget * (1 - AUTO_FIT_MARGIN)
    return min((p for p in plans if p["peak_bytes"] <= limit), key=lambda p: p["rel_step_time"])


def test_train_auto_fit_applies_and_logs_the_plan(trained):
    code, _, doc, log = trained
    assert code == 0
    applied = Plan(**doc["applied"])
    assert f"auto_fit: {applied.name} (predicted peak" in log
    assert "Training finished: 2 iterations" in log
    # 30 MiB holds every plan of a 1 MB model: the fastest of all is applied, and it is the one recommended.
    assert all(p["fits"] for p in doc["plans"])
    assert doc["plans"][doc["recommended"]]["name"] == applied.name == _fastest_fitting(doc["plans"], 30 << 20)["name"]


@pytest.fixture(scope="module")
def squeezed(trained, tmp_path_factory):
    """apply_auto_fit at a budget whose limit lies halfway between the smallest peak and the fastest
    plan's: (budget, fitted config, auto_fit.json)."""
    _, cfg, doc, _ = trained
    peaks = [p["peak_bytes"] for p in doc["plans"]]
    fastest = min(doc["plans"], key=lambda p: p["rel_step_time"])
    assert fastest["peak_bytes"] > min(peaks), "the fastest plan is also the smallest: no budget separates them"
    budget = math.ceil((min(peaks) + fastest["peak_bytes"]) / 2 / (1 - AUTO_FIT_MARGIN))
    assert min(peaks) < budget < max(peaks)
    work = tmp_path_factory.mktemp("autofit_squeezed")
    fitted, line = apply_auto_fit({**cfg, "work_dir": str(work)}, dict(budget=f"{budget}B"))
    return budget, fitted, json.loads((work / "auto_fit.json").read_text()), line


def test_picks_the_fastest_plan_that_fits(squeezed):
    budget, _, doc, line = squeezed
    plans = doc["plans"]
    applied = Plan(**doc["applied"])
    best = _fastest_fitting(plans, budget)
    assert applied.name == best["name"] and plans[doc["recommended"]]["name"] == best["name"], line
    fastest = min(plans, key=lambda p: p["rel_step_time"])
    assert fastest["peak_bytes"] > budget * (1 - AUTO_FIT_MARGIN)  # the budget ruled the fastest out
    assert [p["name"] for p in plans if not p["fits"]]  # and some others with it


def test_the_applied_plan_really_fits(squeezed, trained):
    budget, fitted, doc, _ = squeezed
    _, cfg, _, _ = trained
    plan = Plan(**doc["applied"])
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    assert plan.apply(cfg, facts) == {**fitted, "work_dir": cfg["work_dir"]}
    real = measure_plan(cfg, plan, facts, steps=1)
    assert real.peak_bytes <= budget, (plan.name, real.peak_bytes, budget)


def test_nothing_fits_is_one_line_naming_the_closest_plan(trained, tiny_config, tmp_path, capsys):
    _, _, doc, _ = trained
    smallest = min(p["peak_bytes"] for p in doc["plans"])
    code = main(["train", str(tiny_config(tmp_path)), "--auto-fit", "100KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("memfit: error: ") and "auto_fit: no plan fits 100.0 KiB per rank" in err[0], err[0]
    # The closest plan by name and peak (plans of equal peak may swap places: any of them will do).
    found = re.search(r"the smallest is '([^']+)' at ([0-9.]+) MiB", err[0])
    assert found, err[0]
    closest = [p for p in doc["plans"] if p["peak_bytes"] == smallest]
    assert found.group(1) in {p["name"] for p in closest}, (found.group(1), closest)
    assert found.group(2) == f"{smallest / 2**20:.1f}"
