"""``memfit plan`` and ``memfit bench`` from the command line (``memfit.cli.main``) on the tiny config:
the table, the recommendation, the ``--json`` document's exact keys, the chart, CUDA targets at 8
ranks, one-line errors, and bench's measured-beside-predicted table with its CSV and PNG."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re

import pytest

from memfit.cli import main

TOP_KEYS = {"device", "world_size", "budget_bytes", "input", "plans", "recommended"}
PLAN_KEYS = {"name", "precision", "activation_checkpointing", "sharding", "offload", "efficient_conv_bn_eval",
             "micro_batch", "accumulative_counts", "compile", "channels_last", "fused_optimizer", "tf32",
             "cudnn_benchmark", "peak_bytes", "breakdown", "rel_step_time", "fits", "memory", "paced_by"}
PNG = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> tuple[int, str, str]:
    """``memfit ARGV``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def planned(tiny_config, tmp_path_factory):
    """``memfit plan CFG --json --png`` on this CPU: (exit status, stdout, JSON document, directory). The chart's
    name has no suffix: it is written as a PNG, ``chart.png``."""
    d = tmp_path_factory.mktemp("plan_cli")
    cfg = tiny_config(d)
    code, out, err = run("plan", str(cfg), "--device", "cpu", "--json", str(d / "plan.json"), "--png",
                         str(d / "chart"), "--top", "10")
    assert code == 0, err
    return out, json.loads((d / "plan.json").read_text()), d


def test_plan_prints_the_table_and_the_recommendation(planned):
    out, doc, d = planned
    lines = out.splitlines()
    assert lines[0] == "| plan | peak | relative time | fits |"
    rows = [line for line in lines if line.startswith("| ") and line != lines[0]]
    assert len(rows) == 10 and f"(10 fastest of {len(doc['plans'])} plans; --all shows every one)" in out
    starred = [r for r in rows if re.match(r"\| [^|]* \* \|", r)]
    assert len(starred) == 1  # the recommended plan, marked in the table
    best = doc["plans"][doc["recommended"]]
    assert starred[0].startswith(f"| {best['name']}")
    summary = next(line for line in lines if line.startswith("recommended ("))
    assert re.fullmatch(rf"recommended \(1 x cpu \(\w+\), budget [0-9.]+ GiB per rank\): {re.escape(best['name'])}, "
                        r"peak [0-9.]+ MiB, [0-9.]+x the configured step time", summary), summary
    assert f"wrote {d / 'chart.png'}" in out and f"wrote {d / 'plan.json'}" in out
    assert "planned for input 1x3x32x32 (derived)" in lines  # what every row was planned for
    assert ("speed levers: none; off: compile (its memory is not predicted: ask with --compile), channels_last "
            "(CUDA only), fused (CUDA only), tf32 (CUDA only), cudnn_benchmark (CUDA only)") in lines
    assert "(eager)" not in out  # no compiled plans unless asked for


def test_plan_json_has_exactly_the_documented_keys(planned):
    _, doc, _ = planned
    assert set(doc) == TOP_KEYS
    assert doc["world_size"] == 1 and doc["device"].startswith("cpu") and doc["budget_bytes"] > 0
    assert doc["input"] == {"shape": [1, 3, 32, 32], "boxes_per_image": None, "how": "derived"}
    assert len(doc["plans"]) > 10  # precisions x checkpointing x offload
    for plan in doc["plans"]:
        assert set(plan) == PLAN_KEYS, plan["name"]
        assert plan["peak_bytes"] == sum(plan["breakdown"].values())  # CPU: live tensor bytes, nothing added
        levers = ("compile", "channels_last", "fused_optimizer", "tf32", "cudnn_benchmark")
        assert plan["memory"] == "fake step" and not any(plan[k] for k in levers)  # a CPU target: none
    assert isinstance(doc["recommended"], int) and 0 <= doc["recommended"] < len(doc["plans"])
    assert sum(p["rel_step_time"] == 1.0 for p in doc["plans"]) >= 1  # the configured plan is the unit
    assert [p["rel_step_time"] for p in doc["plans"]] == sorted(p["rel_step_time"] for p in doc["plans"])


def test_plan_writes_the_chart(planned):
    out, _, d = planned
    assert (d / "chart.png").read_bytes()[:8] == PNG and not (d / "chart").exists()
    assert f"wrote {d / 'chart.png'}" in out.splitlines()  # the file written, not the name given


def test_plan_as_is_predicts_the_configured_plan_only(tiny_config, tmp_path, planned):
    code, out, err = run("plan", str(tiny_config(tmp_path)), "--device", "cpu", "--as-is", "--json",
                         str(tmp_path / "p.json"), "--input-shape", "1x3x32x32")
    assert code == 0, err
    doc = json.loads((tmp_path / "p.json").read_text())
    # The size the pipeline makes, given: planned for as given, and the same peak as derived.
    assert doc["input"] == {"shape": [1, 3, 32, 32], "boxes_per_image": None, "how": "given"}
    configured = next(p for p in planned[1]["plans"] if p["name"] == doc["plans"][0]["name"])
    assert doc["plans"][0]["peak_bytes"] == configured["peak_bytes"]
    assert [p["name"] for p in doc["plans"]] == ["fp32 mb1x1"] and doc["recommended"] == 0
    assert "| fp32 mb1x1 (configured) * |" in out
    assert "no chart: one plan has nothing to compare (leave out --as-is to chart every plan)" in out.splitlines()
    assert not (tmp_path / "work" / "plan.png").exists() and "plan.png" not in out


def test_plan_for_8_h100s_adds_the_cuda_figures(tiny_config, tmp_path):
    code, out, err = run("plan", str(tiny_config(tmp_path)), "--gpu", "h100", "--gpus", "8", "--budget", "40GiB",
                         "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    assert out.splitlines()[0] == "| plan | peak | allocated | reserved | relative time | paced by | fits |"
    doc = json.loads((tmp_path / "p.json").read_text())
    # a tiny model's steps on an H100: Python launches kernels slower than the GPU runs them
    assert {p["paced_by"] for p in doc["plans"]} <= {"host", "device", "comm"} and doc["plans"][0]["paced_by"] == "host"
    assert "note: the recommended plan is paced by the host: its GPU waits for Python to launch kernels, idle " in out
    assert doc["device"] == "H100" and doc["world_size"] == 8 and doc["budget_bytes"] == 40 << 30
    assert {p["sharding"] for p in doc["plans"]} == {"none", "zero1", "zero2", "fsdp"}
    for plan in doc["plans"]:
        b = plan["breakdown"]
        assert b["cuda_context"] > 0 and b["nccl"] > 0 and b["workspace"] > 0 and b["allocator_slack"] > 0
        assert plan["peak_bytes"] == sum(b.values())  # the tensors plus what CUDA holds beside them
    assert "recommended (8 x H100, budget 40.00 GiB per rank): " in out


def test_plan_compile_lists_compiled_twins_with_their_eager_memory(tiny_config, tmp_path, planned):
    code, out, err = run("plan", str(tiny_config(tmp_path)), "--device", "cpu", "--compile", "--all", "--json",
                         str(tmp_path / "p.json"))
    assert code == 0, err
    plans = json.loads((tmp_path / "p.json").read_text())["plans"]
    eager = {p["name"]: p for p in planned[1]["plans"]}
    twins = [p for p in plans if p["compile"]]
    assert len(twins) == len(eager)  # one per plan (the configured plan's is the enumerated one's)
    for twin in twins:
        assert twin["memory"] == "eager plan's"
        assert twin["name"].replace(" compile", "") in eager
    rows = [line for line in out.splitlines() if line.startswith("| ") and " compile " in line]
    assert len(rows) == len(twins) and all(re.search(r"\| [0-9.]+ [MG]iB \(eager\) \|", r) for r in rows), rows[:2]
    assert "(eager): a compiled plan's memory is its eager plan's (torch.compile's graphs are not predicted; " \
        "docs/planner.md)" in out


@pytest.mark.parametrize("flag,value,message", [
    ("--gpu", "h900", "--gpu 'h900': not in the planner's table"),
    ("--budget", "lots", "--budget='lots': not a size"),
    ("--budget", "24", "--budget='24': a size needs a unit: 24GiB (2^30 bytes) or 24GB (10^9 bytes)"),
    ("--input-shape", "1x3x32", "--input-shape='1x3x32': give the image batch as BxCxHxW (e.g. 2x3x800x1344) or HxW"),
])
def test_bad_target_or_budget_is_one_line_exit_2(tiny_config, tmp_path, flag, value, message):
    code, out, err = run("plan", str(tiny_config(tmp_path)), "--device", "cpu", flag, value)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("memfit: error: ") and message in lines[0], lines[0]
    assert not out


def test_bench_prints_measured_beside_predicted_and_writes_csv_png(tiny_config, tmp_path):
    cfg = tiny_config(tmp_path)
    code, out, err = run("bench", str(cfg), "--device", "cpu", "--plans", "fp32,fp32 ac:blocks", "--steps", "1",
                         "--out", str(tmp_path / "bench"))
    assert code == 0, err
    assert "measured on input 1x3x32x32 (derived)" in out.splitlines()
    lines = [line for line in out.splitlines() if line.startswith("|")]  # a runner's logger may print too
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:6] == ["plan", "measured_peak_gib", "predicted_peak_gib", "peak_error_pct", "measured_rel_time",
                        "predicted_rel_time"]
    assert [line.split(" | ")[0] for line in lines[2:4]] == ["| fp32 mb1x1", "| fp32 ac:blocks mb1x1"]
    with (tmp_path / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["plan"] for r in rows] == ["fp32 mb1x1", "fp32 ac:blocks mb1x1"]
    assert float(rows[0]["measured_rel_time"]) == 1.0 and float(rows[0]["predicted_rel_time"]) == 1.0
    for r in rows:  # the tiny model's peaks: predicted within the accuracy tests' tolerance
        assert -3 <= float(r["peak_error_pct"]) <= 5, r
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG
