"""The planner's and the bench's output: sizes in GiB/MiB, the Markdown table, the recommendation (or
why there is none), CSV and the ``--json`` document. The chart is :mod:`memfit.planner.chart`."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from memfit.planner.devices import GiB, MiB
from memfit.planner.results import Prediction
from memfit.planner.time_profile import describe


def size(n: float) -> str:
    """Bytes in binary units, as GPU memory is counted: '24.00 GiB', '412.0 MiB' under 1 GiB, '12.0 KiB' under
    0.1 MiB (a tiny budget is not '0.0 MiB')."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB / 10 else f"{n / 1024:.1f} KiB"


EAGER_MARK = " (eager)"  # a compiled plan's peak: its eager plan's


def plan_table(pred: Prediction, limit: int | None = None) -> str:
    """Markdown rows sorted by predicted step time; the recommended plan marked with ``*``, a compiled plan's
    peak with ``(eager)`` (its eager plan's: see :func:`footer`); on a GPU, what paces each step
    (:attr:`memfit.planner.cost.StepTime.bound`)."""
    cuda = pred.device.cuda
    head = "| plan | peak | allocated | reserved | relative time | paced by | fits |" if cuda else \
        "| plan | peak | relative time | fits |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = pred.results if limit is None else pred.results[:limit]
    for i, r in enumerate(rows):
        mark = " *" if i == pred.recommended else ""
        name = f"{r.plan.name}{' (configured)' if r.plan.configured else ''}{mark}"
        peak = size(r.peak_bytes) + (EAGER_MARK if r.plan.compile else "")
        mem = f"{peak} | {size(r.allocated)} | {size(r.reserved)}" if cuda else peak
        time = f"{r.rel_step_time:.2f} | {r.time.bound if r.time else '-'}" if cuda else f"{r.rel_step_time:.2f}"
        lines.append(f"| {name} | {mem} | {time} | {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)


def footer(pred: Prediction) -> str:
    """The speed levers the plans were given (and why the others are off), the step-time profile when it is not
    the target's own (:func:`memfit.planner.time_profile.describe`), and what ``(eager)`` means."""
    lines = [pred.levers.describe()] if pred.levers is not None else []
    profile = describe(pred.device)
    if profile:
        lines.append(profile)
    if any(r.plan.compile for r in pred.results):
        lines.append(f"{EAGER_MARK.strip()}: a compiled plan's memory is its eager plan's (torch.compile's graphs "
                     "are not predicted; docs/planner.md)")
    return "\n".join(lines)


def verdict(pred: Prediction) -> str:
    """The recommendation in one line, or why there is none: the budget, the smallest predicted peak and
    what to try."""
    where = f"{pred.world_size} x {pred.device.name}, budget {size(pred.budget)} per rank"
    if pred.recommended is not None:
        r = pred.results[pred.recommended]
        return (f"recommended ({where}): {r.plan.name}, peak {size(r.peak_bytes)}, "
                f"{r.rel_step_time:.2f}x the configured step time")
    closest = min(pred.results, key=lambda r: r.peak_bytes)
    within = closest.peak_bytes <= pred.budget  # under the budget, not under the margin a prediction keeps free
    peak = f"predicted peak {size(closest.peak_bytes)}" + (", within the budget but not its margin (docs/planner.md, "
                                                           "Fits)" if within else "")
    if len(pred.results) == 1 and closest.plan.configured:
        return (f"the configured plan does not fit ({where}): '{closest.plan.name}', {peak}; try a bigger "
                "--budget, more GPUs (--gpus, --nodes), or leave out --as-is to search every plan")
    return (f"no plan fits ({where}); the smallest is '{closest.plan.name}', {peak}; try a bigger --budget, "
            "more GPUs (--gpus, --nodes), or --as-is to see the configured plan")


def summary(pred: Prediction) -> str:
    """:func:`verdict`, then the prediction's notes, one a line."""
    return verdict(pred) + "".join(f"\nnote: {n}" for n in pred.notes)


def write_json(pred: Prediction, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pred.to_json(), indent=1))
    return path


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path
