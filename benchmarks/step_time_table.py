"""Predicted against measured step time, relative to a reference step measured in the same run.

    python benchmarks/step_time_table.py PREDICTED.csv RUN.json [RUN.json ...]
    python benchmarks/step_time_table.py --parts PREDICTED.csv      # each case by part, against its own run

PREDICTED.csv is what ``benchmarks/gpu_calibration.py compare --composed --out PREDICTED`` wrote (a case's
``predicted_step_s``); each RUN.json is a ``gpu_calibration.py measure`` run (a case's median ``seconds``). A
case's ratio is its step time over its reference's (the same model's fp32 step; Swin-B's and DeiT-B's, which
have none measured, Swin-L's and ViT-L's; DINO's rows, row 1's), predicted and measured; the error is predicted over
measured ratio.
Prints a markdown table and how many cases each run has within 10%. With ``--parts``: each case's predicted kernels
and host beside the run's profiled device busy time and host time (the columns ``compare`` writes), and what paced
it, measured (:func:`memfit.planner.step_profile.paced_by`'s rule on the step's time) and predicted; a device-paced
step's host time includes its waits, so its host is not compared.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

# A case's reference, by the start of its name.
REFERENCES = {"swin-": "swin-l fp32", "vit-l": "vit-l fp32 mb64x1", "deit-b": "vit-l fp32 mb64x1",
              "dino swin-l row": "dino swin-l row 1"}
WITHIN = 0.10


def reference_of(case: str) -> str | None:
    return next((ref for prefix, ref in REFERENCES.items() if case.startswith(prefix)), None)


def table(predicted: dict[str, float], runs: list[dict[str, float]]) -> list[dict]:
    """One row per predicted case with a reference: its plan's ratio predicted and, per run, measured and the
    error (None where the run lacks the case or its reference)."""
    rows = []
    for case, seconds in predicted.items():
        ref = reference_of(case)
        if ref is None or ref not in predicted:
            continue
        row = {"case": case, "predicted": seconds / predicted[ref], "runs": []}
        for run in runs:
            if case in run and ref in run:
                measured = run[case] / run[ref]
                row["runs"].append((run[case], measured, row["predicted"] / measured - 1))
            else:
                row["runs"].append(None)
        rows.append(row)
    return rows


def markdown(rows: list[dict], names: list[str]) -> str:
    head = ["case", *[f"{n} s | {n} relative" for n in names], "predicted", *[f"error, {n}" for n in names]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (1 + 2 * len(names) + 1 + len(names))]
    for r in rows:
        cells = [r["case"]]
        for m in r["runs"]:
            cells += [f"{m[0]:.3f}", f"{m[1]:.3f}"] if m else ["", ""]
        cells.append(f"{r['predicted']:.3f}")
        cells += [f"{100 * m[2]:+.1f}%" if m and r["case"] != reference_of(r["case"]) else "" for m in r["runs"]]
        lines.append("| " + " | ".join(cells) + " |")
    for i, n in enumerate(names):
        errs = [abs(r["runs"][i][2]) for r in rows if r["runs"][i] and r["case"] != reference_of(r["case"])]
        lines.append(f"\n{n}: {sum(e <= WITHIN for e in errs)} of {len(errs)} within {WITHIN:.0%}")
    return "\n".join(lines)


def parts(rows: list[dict[str, str]]) -> str:
    """The ``--parts`` table from ``compare``'s CSV rows."""
    from memfit.planner.step_profile import DEVICE_BUSY

    def pct(predicted: float, measured: float) -> str:
        return f"{measured:.3f} / {predicted:.3f} ({100 * (predicted / measured - 1):+.0f}%)"

    lines = ["| case | paced by, measured / predicted | device busy s / predicted kernels | host s / predicted host |",
             "|---|---|---|---|"]
    for r in rows:
        if not r.get("measured_busy_s") or not r.get("predicted_kernels_s"):
            continue
        busy, step, host = float(r["measured_busy_s"]), float(r["measured_step_s"]), float(r["measured_host_s"])
        measured = "device" if busy >= DEVICE_BUSY * step else "host"
        kernels, predicted_host = float(r["predicted_kernels_s"]), float(r["predicted_host_s"])
        host_cell = pct(predicted_host, host) if measured == "host" else ""
        lines.append(f"| {r['case']} | {measured} / {r['predicted_bound']} | {pct(kernels, busy)} | {host_cell} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--parts"] and len(argv) == 2:
        with open(argv[1], newline="") as f:
            print(parts(list(csv.DictReader(f))))
        return
    if len(argv) < 2:
        raise SystemExit(__doc__)
    with open(argv[0], newline="") as f:
        predicted = {r["case"]: float(r["predicted_step_s"]) for r in csv.DictReader(f)}
    runs = [{m["case"]: m["seconds"] for m in json.loads(Path(p).read_text()) if "seconds" in m} for p in argv[1:]]
    print(markdown(table(predicted, runs), [f"run {i + 1}" for i in range(len(runs))]))


if __name__ == "__main__":
    main(sys.argv[1:])
