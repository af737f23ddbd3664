"""benchmarks/detection_table.py's results: one flat record per row, the two tables of MMDetection's large-model
example with memfit's numbers beside them (Markdown) and a chart of the peaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detection_table_rows import BATCH, BY_ID, EXAMPLE2, GB, ROWS, SEED_INPUT, Row


def table_rows(results: dict[str, list[dict[str, Any]]], predicted: dict[str, float]) -> list[dict[str, Any]]:
    """One flat record per measured row: rank 0's peak and breakdown, the max over ranks, the slowest
    rank's CPU and wall seconds per step, the CPU time's ratio to row 1 (to the first row without it)."""
    base_id = "1" if "1" in results else next(iter(results))
    base_cpu = max(r["cpu"] for r in results[base_id])
    recs = []
    for row in ROWS:
        if row.id not in results:
            continue
        ranks = results[row.id]
        b = ranks[0]["breakdown"]
        cpu = max(r["cpu"] for r in ranks)
        recs.append({
            "id": row.id, "amp": row.amp, "gc_backbone": row.gc_backbone, "gc_encoder": row.gc_encoder,
            "sharding": row.shard or "none", "ranks": len(ranks),
            "peak_gb_rank0": round(ranks[0]["peak"] / GB, 3),
            "peak_gb_max_rank": round(max(r["peak"] for r in ranks) / GB, 3),
            "parameters_gb": round((b["parameters"] + b["buffers"]) / GB, 3),
            "gradients_gb": round(b["gradients"] / GB, 3),
            "optimizer_state_gb": round(b["optimizer_state"] / GB, 3),
            "activations_gb": round(b["activations"] / GB, 3),
            "communication_inputs_gb": round((b["communication"] + b["inputs"]) / GB, 3),
            "step_cpu_s": round(cpu, 2), "step_wall_s": round(max(r["wall"] for r in ranks), 2),
            "time_ratio": round(cpu / base_cpu, 2), "time_base": base_id,
            "planner_seed_size_gb": round(predicted[row.id], 2) if row.id in predicted else "",
            "seed_gb": row.seed_gb, "seed_s": row.seed_s, "seed_time_ratio": round(row.seed_s / ROWS[0].seed_s, 2),
        })
    return recs


def _tick(flag: bool) -> str:
    return "√" if flag else ""


def markdown(recs: list[dict[str, Any]], size: int) -> str:
    """Both of MMDetection's tables, its numbers beside memfit's, then the breakdown of every row."""
    by_id = {r["id"]: r for r in recs}
    planned = any(r["planner_seed_size_gb"] != "" for r in recs)
    head = ["ID", "AMP", "GC of Backbone", "GC of Encoder", "FSDP", "Peak Mem (GB) MMDetection",
            "Iter Time ratio MMDetection", f"Peak Mem (GB) memfit {size} px, rank 0 / max", "Iter Time ratio memfit"]
    if planned:
        head.append(f"Peak Mem (GB) memfit planner {SEED_INPUT[0]}x{SEED_INPUT[1]}")

    def line(ex_id: str, row: Row, shard: str, seed_gb: float, seed_s: float) -> str:
        r = by_id.get(row.id)
        cells = [ex_id, _tick(row.amp), _tick(row.gc_backbone), _tick(row.gc_encoder), _tick(row.shard == shard),
                 f"{seed_gb:g}", f"{seed_s / ROWS[0].seed_s:.2f}"]
        if r is None:
            cells += [""] * (len(head) - len(cells))
        else:
            peak = f"{r['peak_gb_rank0']:.2f}" + (f" / {r['peak_gb_max_rank']:.2f}" if r["ranks"] > 1 else "")
            cells += [peak, f"{r['time_ratio']:.2f}"]
            if planned:
                cells.append(f"{r['planner_seed_size_gb']:.1f}" if r["planner_seed_size_gb"] != "" else "")
        return "| " + " | ".join(cells) + " |"

    out = [f"Example 1 (FSDP): memfit at {size}x{size} px, {BATCH} images/rank; MMDetection at ~1333x800, 8 GPUs",
           "", "| " + " | ".join(head) + " |", "|" + ":-:|" * len(head)]
    out += [line(row.id, row, "fsdp", row.seed_gb, row.seed_s) for row in ROWS[:8]]
    out += ["", "Example 2 (DeepSpeed ZeRO-3): rows 1, 2, 3, 5 are Example 1's rows 1, 2, 4, 6", "",
            "| " + " | ".join(h.replace("FSDP", "DeepSpeed") for h in head) + " |", "|" + ":-:|" * len(head)]
    out += [line(ex_id, BY_ID[rid], "deepspeed", gb, s) for ex_id, rid, gb, s in EXAMPLE2]
    head3 = ["ID", "ranks", "peak rank 0", "parameters", "gradients", "optimizer state", "activations",
             "comm + inputs", "CPU s/step", "wall s/step"]
    out += ["", f"Breakdown at rank 0's peak (GB), memfit at {size} px", "", "| " + " | ".join(head3) + " |",
            "|" + "---|" * len(head3)]
    out += [f"| {r['id']} | {r['ranks']} | {r['peak_gb_rank0']:.2f} | {r['parameters_gb']:.2f}"
            f" | {r['gradients_gb']:.2f} | {r['optimizer_state_gb']:.2f} | {r['activations_gb']:.2f}"
            f" | {r['communication_inputs_gb']:.2f} | {r['step_cpu_s']:.1f} | {r['step_wall_s']:.1f} |" for r in recs]
    return "\n".join(out)


def chart(recs: list[dict[str, Any]], size: int, path: Path) -> None:
    """Left: rank 0's peak broken down by part; right: each row's peak relative to row 1's, memfit (and its
    planner at MMDetection's size, when run) beside MMDetection's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["parameters_gb", "gradients_gb", "optimizer_state_gb", "activations_gb", "communication_inputs_gb"]
    labels = [r["id"] + (f" ({r['sharding']})" if r["sharding"] != "none" else "") for r in recs]
    x = list(range(len(recs)))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    bottom = [0.0] * len(recs)
    for part in parts:
        vals = [r[part] for r in recs]
        ax.bar(x, vals, bottom=bottom, label=part.removesuffix("_gb").replace("_", " ").replace("n i", "n + i"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, max(bottom) * 1.3)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB (2**30 bytes)")
    ax.set_title(f"memfit, {size} px, {BATCH} images/rank: rank 0's peak by part", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    ref = next((r for r in recs if r["id"] == "1"), recs[0])
    series = [(f"memfit {size} px (CPU)", [r["peak_gb_rank0"] / ref["peak_gb_rank0"] for r in recs])]
    if ref["planner_seed_size_gb"] != "":
        series.append(("memfit planner, MMDetection's size (GPU)", [
            r["planner_seed_size_gb"] / ref["planner_seed_size_gb"] if r["planner_seed_size_gb"] != "" else 0.0
            for r in recs]))
    series.append(("MMDetection (GPU)", [r["seed_gb"] / ref["seed_gb"] for r in recs]))
    w = 0.8 / len(series)
    for k, (name, vals) in enumerate(series):
        ax2.bar([i + (k - (len(series) - 1) / 2) * w for i in x], vals, w, label=name)
    ax2.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel(f"peak / row {ref['id']}'s peak")
    ax2.set_title(f"peak relative to row {ref['id']}", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
