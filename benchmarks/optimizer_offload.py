"""Optimizer offload: device peak, host memory and step time with and without ``cfg.optimizer_offload``.

    python benchmarks/optimizer_offload.py             # ViT-B/16 (86M), 224 px, batch 8, AdamW
    python benchmarks/optimizer_offload.py --quick     # batch 2, 2 timed steps

Each row builds the model afresh (seed 0) through memfit's set-up (the path ``Runner`` takes), runs a
warm-up step (the optimizer state exists from then on), one step under memfit's MemoryTracker (device
peak and breakdown; the offloaded optimizer's memory counted apart as host memory) and ``--steps``
timed steps (median), the ratio against the plain row of the same precision in the same run. On a CPU
the "host link" is a memory copy, so the time column shows the copies and the unfused host step, not
PCIe. Prints a Markdown table, writes ``benchmarks/results/optimizer_offload.csv`` and ``.png``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from techniques import tracked_and_timed  # benchmarks/ is the script's directory
from torch import nn

from memfit.connector import setup
from memfit.measure import MB
from memfit.strategies import SingleDeviceStrategy

RESULTS = Path(__file__).parent / "results"
ROWS = [  # (name, precision, activation checkpointing, offload)
    ("fp32", "fp32", False, False),
    ("fp32 + optimizer offload", "fp32", False, True),
    ("bf16 + AC blocks", "bf16", True, False),
    ("bf16 + AC blocks + optimizer offload", "bf16", True, True),
]


def measure(precision: str, ac: bool, offload: bool, batch: int, steps: int) -> dict[str, float]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10, drop_path_rate=0.0)
    optim = dict(optimizer=dict(type="AdamW", lr=1e-4, weight_decay=0.05))
    if precision == "bf16":
        optim.update(type="AmpOptimWrapper", dtype="bfloat16")
    techniques = dict(activation_checkpointing=dict(types=["Block"])) if ac else {}
    model, wrapper = setup(model, SingleDeviceStrategy(), optim, techniques, optimizer_offload=offload)
    x, y = torch.randn(batch, 3, 224, 224), torch.arange(batch) % 10

    def step() -> None:
        with wrapper.optim_context(model):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        wrapper.update_params(loss)

    tracker, seconds = tracked_and_timed(step, model, wrapper.optimizer, steps)
    b = tracker.breakdown
    return {"device_peak_mb": tracker.peak_bytes / MB, "host_peak_mb": tracker.host_peak_bytes / MB,
            "parameters_mb": b["parameters"] / MB, "gradients_mb": b["gradients"] / MB,
            "optimizer_state_mb": b["optimizer_state"] / MB, "activations_mb": b["activations"] / MB,
            "step_s": seconds}


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [r["plan"] for r in rows]
    ax.barh(names, [r["device_peak_mb"] for r in rows], label="device peak")
    ax.barh(names, [r["host_peak_mb"] for r in rows], left=[r["device_peak_mb"] for r in rows],
            label="host (offloaded)", alpha=0.5)
    ax.set_xlabel("MB (memfit's tracker)")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    batch, steps = (2, 2) if args.quick else (8, args.steps or 5)
    print(f"ViT-B/16, 224 px, batch {batch}, AdamW, CPU ({torch.backends.cpu.get_cpu_capability()}), "
          f"median of {steps} steps")
    rows = []
    for name, precision, ac, offload in ROWS:
        res = measure(precision, ac, offload, batch, steps)
        rows.append({"plan": name, **{k: round(v, 3) for k, v in res.items()}})
        print(f"  {name}: device {res['device_peak_mb']:.1f} MB, host {res['host_peak_mb']:.1f} MB", flush=True)
    base = {r["plan"]: r for r in rows}
    head = ["plan", "device peak MB", "host MB", "params MB", "grads MB", "optim state MB", "activations MB",
            "step time vs same precision without offload"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        plain = base[r["plan"].replace(" + optimizer offload", "")]
        r["step_time_ratio"] = round(r["step_s"] / plain["step_s"], 3)
        lines.append(f"| {r['plan']} | {r['device_peak_mb']:.1f} | {r['host_peak_mb']:.1f} | {r['parameters_mb']:.1f}"
                     f" | {r['gradients_mb']:.1f} | {r['optimizer_state_mb']:.1f} | {r['activations_mb']:.1f}"
                     f" | {r['step_time_ratio']:.2f}x |")
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "optimizer_offload.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    chart(rows, RESULTS / "optimizer_offload.png")
    print(f"wrote {RESULTS / 'optimizer_offload.csv'} and .png")


if __name__ == "__main__":
    main()
