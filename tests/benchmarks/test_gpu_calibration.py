"""benchmarks/gpu_calibration.py's measure stage: cases of one config grouped in one process, what comes back."""

from __future__ import annotations

import json
import subprocess

SLOT = [18, 19, 20, 21, 22, 23, 24, 25, 0, 1, 2, 3, 4, 5, 6, 7, 26, 27, 28]  # benchmarks/gpu_slot.sh's default


def test_cases_of_one_config_share_a_process(bench_script):
    cal = bench_script("gpu_calibration")
    assert cal.case_groups(SLOT) == [SLOT[:8], SLOT[8:16], [26], [27, 28]]  # ViT-L, Swin-L, Swin-B, DeiT-B
    assert cal.case_groups([12, 13, 14]) == [[12], [13], [14]]  # DINO's rows: each alone
    assert cal.case_groups([0, 18, 1]) == [[0], [18], [1]]  # only consecutive cases


def _case(cal, i: int) -> dict:
    return {"case": cal.CASES[i][0], "allocated": 1, "reserved": 2, "outside_allocator": 0, "context_bare": 0,
            "cublas_workspace": 0, "seconds": 0.1, "host_times": [0.1], "case_s": 3.0}


def test_a_group_keeps_each_cases_result_and_failure(bench_script, monkeypatch, tmp_path):
    cal = bench_script("gpu_calibration")
    calls = []

    def child(*args, times=1):
        calls.append((args, times))
        indices = [int(a) for a in args[1:]]
        if indices == [0, 1, 2]:  # the second case fails, then the process runs out of time
            lines = [_case(cal, 0), {"case": cal.CASES[1][0], "error": "CUDA out of memory"}]
            return subprocess.CompletedProcess([], 124, "\n".join(map(json.dumps, lines)), "timed out")
        return subprocess.CompletedProcess([], 0, "\n".join(json.dumps(_case(cal, i)) for i in indices), "")

    monkeypatch.setattr(cal, "_child", child)
    cal.measure(tmp_path, [0, 1, 2, 26], group=True)
    assert calls == [(("one", "0", "1", "2"), 3), (("one", "26"), 1)]
    out = json.loads((tmp_path / "measured.json").read_text())
    assert [r["case"] for r in out] == [cal.CASES[i][0] for i in (0, 1, 2, 26)]
    assert out[0]["wall_s"] == 3.0 and "error" not in out[0]
    assert out[1]["error"] == "CUDA out of memory"
    assert out[2]["error"].startswith("rc=124")  # never printed: the process ran out of time first
    assert "error" not in out[3]
