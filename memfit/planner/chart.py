"""``memfit plan``'s chart: which plan, at what cost. Predicted peak per rank against relative step time
(log axis, clipped to where the choices are), plans that fit and plans that do not, the budget, and the
Pareto front of the fitting plans numbered on the chart and named, with their time and peak, beside it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.planner.devices import GiB, MiB
from memfit.planner.predict import AUTO_FIT_MARGIN
from memfit.planner.report import size
from memfit.planner.results import Prediction

MAX_LABELS = 8  # Pareto points named beside the chart
CLIP = 4.0  # plans over 4x the fastest one's time (1.3x the chosen one's if more) sit at the right edge
TICKS = (0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100,
         200, 500, 1000)


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (smaller is better), by the first."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def labelled(front: list[int], keep: set[int], most: int = MAX_LABELS) -> list[int]:
    """At most ``most`` of ``front`` (ordered), spread evenly along it, always with its ends and ``keep``."""
    if len(front) <= most:
        return front
    picks = {front[0], front[-1], *(i for i in keep if i in front)}
    spare = most - len(picks)
    step = (len(front) - 1) / (spare + 1)
    picks |= {front[round(step * (k + 1))] for k in range(spare)}
    return [i for i in front if i in picks][:most]


def _time_ticks(lo: float, hi: float) -> list[float]:
    """The round ratios between ``lo`` and ``hi``, thinned to at most eleven (1x always among them)."""
    inside = [t for t in TICKS if lo <= t <= hi]
    while len(inside) > 11:
        one = inside.index(1) if 1 in inside else 0
        inside = [t for k, t in enumerate(inside) if (k - one) % 2 == 0]
    return inside


def plan_figure(pred: Prediction) -> Any:
    """The chart as a matplotlib Figure, or None for fewer than two plans (nothing to compare)."""
    if len(pred.results) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D


    results = pred.results
    times = [r.rel_step_time for r in results]
    scale, unit = (GiB, "GiB") if max(r.peak_bytes for r in results) >= GiB else (MiB, "MiB")
    peaks = [r.peak_bytes / scale for r in results]
    fits = [r.fits for r in results]
    rec = pred.recommended
    # The plans a reader must see: the recommended one, else (nothing fits) the one with the smallest peak.
    chosen = rec if rec is not None else min(range(len(results)), key=lambda i: results[i].peak_bytes)
    cap = max(CLIP * min(times), 1.3 * times[chosen])
    clipped = [i for i, t in enumerate(times) if t > cap]
    right = max(t for t in times if t <= cap) * 1.15
    left = min(times) / 1.15

    fig, (ax, side) = plt.subplots(1, 2, figsize=(12, 5.4), gridspec_kw={"width_ratios": [1.4, 1]})
    side.axis("off")
    for group, marker, color, label in ((True, "o", "tab:green", "fits"), (False, "x", "tab:gray", "does not fit")):
        shown = [i for i in range(len(results)) if fits[i] == group and i not in clipped]
        edge = [i for i in clipped if fits[i] == group]
        ax.scatter([times[i] for i in shown], [peaks[i] for i in shown], s=14, marker=marker, color=color,
                   alpha=0.7, linewidths=1, label=f"{label} ({len(shown) + len(edge)})")
        ax.scatter([right] * len(edge), [peaks[i] for i in edge], s=18, marker=">", color=color, alpha=0.5,
                   clip_on=False)

    # The Pareto front of the plans that fit (of every plan when none does): the fastest for its memory.
    pool = [i for i in range(len(results)) if fits[i] and i not in clipped] or \
        [i for i in range(len(results)) if i not in clipped]
    front = [pool[k] for k in pareto([(times[i], peaks[i]) for i in pool])]
    fx, fy = [times[i] for i in front], [peaks[i] for i in front]
    ax.step(fx, fy, where="post", color="tab:blue", linewidth=1.2,
            label="Pareto front" + ("" if any(fits[i] for i in front) else " (none fit)"))
    names = labelled(front, {chosen})
    ax.scatter([times[i] for i in names], [peaks[i] for i in names], s=36, facecolors="none",
               edgecolors="tab:blue", linewidths=1.2)
    for n, i in enumerate(names, 1):
        # Below-left of the front is empty: odd numbers go there, even ones above-right (neighbours apart),
        # the chosen plan's below-left (its star), and none off the axes' left or right edge.
        at_left, at_right = times[i] < left * 1.08, times[i] > right / 1.15
        below = at_right or (not at_left and (n % 2 == 1 or i == chosen))
        ax.annotate(str(n), (times[i], peaks[i]), xytext=(-9, -12) if below else (5, 4),
                    textcoords="offset points", fontsize=8, color="tab:blue", weight="bold")

    if rec is not None:
        ax.scatter([times[rec]], [peaks[rec]], s=150, marker="*", color="gold", edgecolors="black", zorder=4,
                   label="recommended")
    configured = next((i for i, r in enumerate(results) if r.plan.configured and i not in clipped), None)
    if configured is not None:
        ax.scatter([times[configured]], [peaks[configured]], s=60, marker="s", facecolors="none",
                   edgecolors="black", zorder=4, label="configured (time 1x)")

    top = max(peaks[i] for i in range(len(results)) if i not in clipped) * 1.12
    budget = pred.budget / scale
    margin = budget * (1 - AUTO_FIT_MARGIN)
    if budget <= 2 * top:
        top = max(top, budget * 1.08)
        ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1.2, label=f"budget {size(pred.budget)}")
        ax.axhline(margin, color="tab:red", linestyle=":", linewidth=0.8,
                   label=f"budget less {AUTO_FIT_MARGIN:.0%} (the recommendation's limit)")
        budget_note = ""
    else:
        budget_note = f"budget {size(pred.budget)}: far above every plan (not drawn)"

    ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.set_ylim(0, top)
    ticks = _time_ticks(left, right)
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("predicted step time, relative to the configured plan (log scale)")
    ax.set_ylabel(f"predicted peak per rank ({unit})")

    dev = pred.device
    title = f"memfit plan: {pred.world_size} x {dev.name} ({size(dev.memory)}), budget {size(pred.budget)} per rank"
    fig.suptitle(title + ("" if rec is not None else ": no plan fits"), fontsize=11, x=0.02, ha="left")
    handles, labels = ax.get_legend_handles_labels()
    if clipped:
        handles.append(Line2D([], [], marker=">", color="tab:gray", linestyle=""))
        slow = [times[i] for i in clipped]
        span = f"{min(slow):.3g}x" + (f" to {max(slow):.3g}x" if len(slow) > 1 else "")
        labels.append(f"{len(slow)} slower plan{'s' if len(slow) > 1 else ''} ({span}), at the right edge")
    side.legend(handles, labels, loc="lower left", fontsize=8, frameon=False, borderaxespad=0)
    key = _key(pred, names, any(fits[i] for i in front), budget_note)
    side.text(0, 1, key, transform=side.transAxes, fontsize=8, va="top", family="monospace")
    fig.tight_layout()
    return fig


def _key(pred: Prediction, names: list[int], fitting: bool, budget_note: str) -> str:
    """The text beside the chart: the plans and input, then the numbered Pareto plans' time, peak and name."""

    results = pred.results
    lines = [f"{len(results)} plans" + (f", {pred.input.describe()}" if pred.input is not None else "")]
    if budget_note:
        lines.append(budget_note)
    lines += ["", "Pareto front" + ("" if fitting else " (no plan fits)") + ": the fastest plan for its memory",
              "", f"{'':3}{'time':>6}  {'peak':>10}  plan"]
    for n, i in enumerate(names, 1):
        r = results[i]
        mark = "  (recommended)" if i == pred.recommended else ""
        lines.append(f"{n:>2} {r.rel_step_time:>5.2f}x  {size(r.peak_bytes):>10}  {r.plan.name}{mark}")
    return "\n".join(lines)


def write_png(pred: Prediction, path: str | Path) -> Path | None:
    """Write :func:`plan_figure` to ``path``; None (nothing written) for a single plan."""
    fig = plan_figure(pred)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = Path(path)
    path = path if path.suffix else path.with_suffix(".png")  # what savefig writes for a name without one
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
