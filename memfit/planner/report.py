"""The planner's and the bench's output: the seed-style Markdown table, a PNG of peak memory against
relative step time (budget line, Pareto front), CSV and the ``--json`` document."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.planner.results import Prediction

GB = 2**30  # the seed's tables say "GB" for GiB, as nvidia-smi does


def size(n: float) -> str:
    """Bytes as the seeds write them: '24.00 GB', or '412 MB' under 1 GB (GB = GiB, MB = MiB)."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 2**20:.1f} MB"


EAGER_MARK = " (eager)"  # a compiled plan's peak: its eager plan's


def plan_table(pred: Prediction, limit: int | None = None) -> str:
    """Markdown rows sorted by predicted step time; the recommended plan marked with ``*``, a compiled plan's
    peak with ``(eager)`` (its eager plan's: see :func:`footer`)."""
    cuda = pred.device.cuda
    head = "| plan | peak | allocated | reserved | relative time | fits |" if cuda else \
        "| plan | peak | relative time | fits |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = pred.results if limit is None else pred.results[:limit]
    for i, r in enumerate(rows):
        mark = " *" if i == pred.recommended else ""
        name = f"{r.plan.name}{' (configured)' if r.plan.configured else ''}{mark}"
        peak = size(r.peak_bytes) + (EAGER_MARK if r.plan.compile else "")
        mem = f"{peak} | {size(r.allocated)} | {size(r.reserved)}" if cuda else peak
        lines.append(f"| {name} | {mem} | {r.rel_step_time:.2f} | {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)


def footer(pred: Prediction) -> str:
    """The speed levers the plans were given (and why the others are off), and what ``(eager)`` means."""
    lines = [pred.levers.describe()] if pred.levers is not None else []
    if any(r.plan.compile for r in pred.results):
        lines.append(f"{EAGER_MARK.strip()}: a compiled plan's memory is its eager plan's (torch.compile's graphs "
                     "are not predicted; docs/planner.md)")
    return "\n".join(lines)


def summary(pred: Prediction) -> str:
    """The recommendation in one line (or why there is none), then the prediction's notes."""
    where = f"{pred.world_size} x {pred.device.name}, budget {size(pred.budget)} per rank"
    notes = "".join(f"\nnote: {n}" for n in pred.notes)
    if pred.recommended is None:
        closest = min(pred.results, key=lambda r: r.peak_bytes)
        return f"no plan fits ({where}); the smallest is '{closest.plan.name}' at {size(closest.peak_bytes)}{notes}"
    r = pred.results[pred.recommended]
    return (f"recommended ({where}): {r.plan.name}, peak {size(r.peak_bytes)}, "
            f"{r.rel_step_time:.2f}x the configured step time{notes}")


def write_json(pred: Prediction, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pred.to_json(), indent=1))
    return path


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (smaller is better)."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def write_png(pred: Prediction, path: str | Path) -> Path:
    """Peak memory against relative step time, one dot per plan, with the budget and the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r.rel_step_time, r.peak_bytes / GB) for r in pred.results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, c=["tab:green" if r.fits else "tab:gray"
                                                                  for r in pred.results])
    front = pareto(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-", color="tab:blue", label="Pareto front")
    ax.axhline(pred.budget / GB, color="tab:red", linestyle="--", label="budget")
    if pred.recommended is not None:
        x, y = pts[pred.recommended]
        ax.scatter([x], [y], s=80, facecolors="none", edgecolors="black", label="recommended")
        ax.annotate(pred.results[pred.recommended].plan.name, (x, y), fontsize=7, xytext=(5, 5),
                    textcoords="offset points")
    ax.set_xlabel("relative step time (configured plan = 1)")
    ax.set_ylabel("predicted peak per rank (GB)")
    ax.set_title(f"memfit plan: {pred.world_size} x {pred.device.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path
