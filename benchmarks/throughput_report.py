"""benchmarks/gpu_throughput.py's results: Markdown tables on stdout, and CSV, PNG and JSON files."""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import textwrap
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(p: dict, q: dict | None, paired: bool) -> float | None:
    """Median of per-round ratios (the rounds ran side by side), else the ratio of the medians."""
    if q is None or not p["img_s"] or not q["img_s"]:
        return None
    if paired:
        return statistics.median(a / b for a, b in zip(p["img_s"], q["img_s"]))
    return statistics.median(p["img_s"]) / statistics.median(q["img_s"])


def summarize(records: list[dict]) -> None:
    """Add each path's median img/s and its ratios to the plain path and to its lever's base, in place."""
    for rec in records:
        paths = rec["paths"]
        for r in paths.values():
            r["img_s_median"] = _median(r["img_s"])
            r["vs_plain"] = _ratio(r, paths.get("plain"), rec.get("interleaved", True))
            r["vs_base"] = _ratio(r, paths.get(r["base"]), rec.get("interleaved", True)) if r["base"] else None


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def _gib(x: int | None) -> str:
    return "—" if x is None else f"{x / GIB:.2f}"


def _note(r: dict) -> str:
    if r.get("error"):
        return f"not run: {r['error']}"
    return f"plan: {r['plan']}" if r.get("plan") else ""


def markdown(records: list[dict]) -> str:
    lines = ["| case | path | img/s (median) | vs plain | vs base | rounds | max allocated GiB | max reserved GiB "
             "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        if not rec["paths"]:
            lines.append(f"| {rec['case']} | — | — | — | — | — | — | — | {rec.get('skipped') or rec.get('error')} |")
        for r in rec["paths"].values():
            base = f"{r['vs_base']:.3f}x vs {r['base']}" if r["vs_base"] is not None else "—"
            lines.append(f"| {rec['case']} | {r['path']} | {_fmt(r['img_s_median'], '.0f')} "
                         f"| {_fmt(r['vs_plain'], '.3f', 'x')} | {base} | {len(r['img_s'])} "
                         f"| {_gib(r.get('max_allocated'))} | {_gib(r.get('max_reserved'))} | {_note(r)} |")
    levers = [(rec, r) for rec in records for r in rec["paths"].values() if r["base"]]
    if levers:
        lines += ["", "| model | lever | factor vs base (median of rounds) | rounds | note |", "|---|---|---|---|---|"]
        for rec, r in levers:
            lines.append(f"| {rec['model']} {rec['dtype']} | {r['path']} | {_fmt(r['vs_base'], '.3f', 'x')} "
                         f"| {len(r['img_s'])} | {_note(r)} |")
    planned = [rec for rec in records if rec.get("planner")]
    if planned:
        lines += ["", "| case | planner budget GiB | plan | predicted peak GiB | predicted time vs configured "
                  "| planned: measured reserved GiB | predict s |", "|---|---|---|---|---|---|---|"]
        for rec in planned:
            p, r = rec["planner"], rec["paths"].get("memfit planned", {})
            lines.append(f"| {rec['case']} | {p['budget_bytes'] / GIB:.2f} | {p.get('plan_name', p.get('error'))} "
                         f"| {_gib(p.get('predicted_peak_bytes'))} | {_fmt(p.get('predicted_rel_step_time'), '.3f')} "
                         f"| {_gib(r.get('max_reserved'))} | {_fmt(p.get('predict_s'), '.1f')} |")
    return "\n".join(lines)


def _csv(records: list[dict], path: Path) -> None:
    fields = ["case", "path", "base", "img_s", "vs_plain", "vs_base", "rounds", "max_allocated_gib",
              "max_reserved_gib", "plan", "note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for rec in records:
            for r in rec["paths"].values():
                w.writerow({"case": rec["case"], "path": r["path"], "base": r["base"] or "",
                            "img_s": _fmt(r["img_s_median"], ".1f"), "vs_plain": _fmt(r["vs_plain"], ".4f"),
                            "vs_base": _fmt(r["vs_base"], ".4f"), "rounds": len(r["img_s"]),
                            "max_allocated_gib": _gib(r.get("max_allocated")),
                            "max_reserved_gib": _gib(r.get("max_reserved")), "plan": r.get("plan", ""),
                            "note": r.get("error", "")})


def _chart(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(rec, r) for rec in records for r in rec["paths"].values() if r["img_s_median"]]
    if not rows:
        return
    colours = {"plain": "gray", "runner": "tab:blue", "planned": "tab:green"}
    fig, ax = plt.subplots(figsize=(8.0, 0.32 * len(rows) + 1.2))
    labels = [f"{rec['case']}: {r['path']}" for rec, r in rows]
    values = [r["img_s_median"] for _, r in rows]
    bars = ax.barh(range(len(rows)), values,
                   color=[colours["runner"] if r["base"] else colours[r["kind"]] for _, r in rows])
    for bar, (_, r) in zip(bars, rows):
        ratio = r["vs_base"] if r["base"] else r["vs_plain"]
        text = f"{r['img_s_median']:.0f}" + (f" ({ratio:.2f}x)" if ratio is not None and r["kind"] != "plain" else "")
        ax.annotate(text, (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=7,
                    xytext=(2, 0), textcoords="offset points")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max(values))
    ax.set_xlabel("images / s (median over rounds); ratio to plain, or to the lever's base")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(args: Any) -> dict:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    for name in ("torchvision", "timm"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu (smoke)"
    return env


def report(records: list[dict], args: Any, seconds: float) -> None:
    """Print the tables and write gpu_throughput.{csv,png,json} to ``args.out``."""
    summarize(records)
    env = environment(args)
    title = (f"{env['device']}, torch {env['torch']}: {args.warmup} warm-up steps, {args.rounds} rounds x "
             f"{args.block} steps per path (short cases half), {args.workers} loader workers")
    print(f"\n{title}; whole run {seconds:.0f} s\n")
    print(markdown(records))
    args.out.mkdir(parents=True, exist_ok=True)
    _csv(records, args.out / "gpu_throughput.csv")
    _chart(records, args.out / "gpu_throughput.png", title)
    doc = {"environment": env, "seconds": round(seconds, 1),
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "cases": records}
    (args.out / "gpu_throughput.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nwrote {args.out}/gpu_throughput.csv, .png, .json")
