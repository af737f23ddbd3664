"""benchmarks/step_time_table.py: step times relative to the reference measured in the same run."""

from __future__ import annotations

import json

import pytest


def test_ratios_against_each_runs_own_reference(tmp_path, capsys, bench_script):
    st = bench_script("step_time_table")
    predicted = {"swin-l fp32": 0.2, "swin-l bf16": 0.1, "swin-b bf16 fsdp (one rank)": 0.15, "vit-t fp32 (demo)": 0.01}
    fast = {"swin-l fp32": 0.2, "swin-l bf16": 0.08, "swin-b bf16 fsdp (one rank)": 0.15}
    slow_host = {"swin-l fp32": 0.2, "swin-l bf16": 0.125}  # the same GPU time, a slower host: no Swin-B
    rows = {r["case"]: r for r in st.table(predicted, [fast, slow_host])}
    assert "vit-t fp32 (demo)" not in rows  # no reference
    assert rows["swin-l bf16"]["predicted"] == pytest.approx(0.5)
    (_, rel1, err1), (_, rel2, err2) = rows["swin-l bf16"]["runs"]
    assert (rel1, rel2) == (pytest.approx(0.4), pytest.approx(0.625))
    assert (err1, err2) == (pytest.approx(0.25), pytest.approx(-0.2))
    assert rows["swin-b bf16 fsdp (one rank)"]["runs"][1] is None  # run 2 lacks it
    (tmp_path / "p.csv").write_text("case,predicted_step_s\n" + "".join(f"{c},{s}\n" for c, s in predicted.items()))
    run = [{"case": "swin-l fp32", "seconds": 0.2}, {"case": "swin-l bf16", "seconds": 0.1}]
    (tmp_path / "r.json").write_text(json.dumps(run))
    st.main([str(tmp_path / "p.csv"), str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "| swin-l bf16 | 0.100 | 0.500 | 0.500 | +0.0% |" in out and "run 1: 1 of 1 within 10%" in out
