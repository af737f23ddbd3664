"""Gather ``gpu_calibration.py measure --trace`` recordings (``trace_<case>.json.gz``: two optimizer steps from an
empty allocator) into one small test fixture of the large models' traces:

    python benchmarks/allocator_trace_fixture.py DIR/trace_19.json.gz ... --out tests/fixtures/allocator/FILE.json.gz

Keeps each case's name, plan, recording environment, per-step peaks (``steps``: ``trace_len``, ``allocated``,
``reserved``, ``max_allocated``, ``max_reserved``) and its allocation, free and segment rows (columns ``action``,
``addr``, ``size``, ``stream``; the ``free_requested`` and ``snapshot`` rows are dropped, and ``trace_len`` counts
the rows kept)."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

KEPT = ("alloc", "free_completed", "segment_alloc", "segment_free")


def case_of(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        rec = json.load(f)
    rows, steps, kept = rec["trace"], [], 0
    bounds = [s["trace_len"] for s in rec["steps"]]
    out_rows = []
    for i, row in enumerate(rows):
        while bounds and i == bounds[0]:
            steps.append(kept)
            bounds.pop(0)
        if row[0] in KEPT:
            out_rows.append(row)
            kept += 1
    steps += [kept] * len(bounds)
    return {"name": rec["case"], "plan": rec["plan"], "torch": rec["torch"], "cuda": rec["cuda"], "gpu": rec["gpu"],
            "recording": rec["recording"],
            "steps": [{**s, "trace_len": n} for s, n in zip(rec["steps"], steps)], "trace": out_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    doc = {"format": "memfit.allocator_traces.steps", "format_version": 1,
           "trace_fields": ["action", "addr", "size", "stream"], "cases": [case_of(p) for p in args.traces]}
    with gzip.open(args.out, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB, {len(doc['cases'])} cases)")


if __name__ == "__main__":
    main()
