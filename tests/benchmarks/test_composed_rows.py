"""benchmarks/composed_rows.py's plan lists: each line is a plan name as `memfit plan` prints it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.planner.commands import parse_plan
from memfit.planner.fake import build_meta_model
from memfit.planner.space import ModelFacts, configured_plan

from .conftest import BENCHMARKS


@pytest.mark.parametrize("model,listing", [("vit-b6", "composed_rows_vit_b6.txt"),
                                           ("swin-l", "composed_rows_swin_l.txt")])
def test_each_listed_plan_is_named_as_the_planner_names_it(bench_script, model, listing):
    cfg = bench_script("composed_rows").config(model)
    base = configured_plan(cfg, ModelFacts.of(build_meta_model(cfg["model"])), True)
    names = [n.strip() for n in (BENCHMARKS / listing).read_text().splitlines() if n.strip()]
    assert len(names) == len(set(names)) >= 24
    for name in names:
        assert replace(parse_plan(name, base), configured=False).name == name
