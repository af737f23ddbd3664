"""Technique matrix: memory-saving switches on/off -> peak memory, breakdown, step time.

    python benchmarks/techniques.py            # (a) resnet18 128px batch 32, (b) ViT-B/16 224px batch 8
    python benchmarks/techniques.py --quick    # fewer rows, batch 4 for ViT-B, 2 timed steps
    python benchmarks/techniques.py --only resnet18

For each row a fresh model (seed 0) gets the techniques, runs one warm-up step (so the optimizer
state exists, as in every step after the first), one step under memfit's MemoryTracker (peak and
breakdown at the peak) and ``--steps`` timed steps without the tracker (median). The step-time
ratio is against the plain row measured in the same run. Prints a Markdown table and writes
``benchmarks/results/techniques_<model>.csv`` and ``.png``.

The resnet18 setup is the one the MMEngine 0.10.7 reference numbers were measured with on this
machine (torchvision resnet18, 10 classes, all BatchNorm in eval, 128x128, batch 32, SGD momentum);
they are printed beside memfit's. "MB" is 2**20 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.measure import MB, MemoryTracker
from memfit.memory.checkpointing import apply_activation_checkpointing

RESULTS = Path(__file__).parent / "results"
LAYERS = ["layer1", "layer2", "layer3", "layer4"]
BLOCKS = [f"{layer}.{i}" for layer in LAYERS for i in (0, 1)]

# MMEngine 0.10.7 on this machine, same resnet18 setup (its AMP needed a patch to run on CPU).
MMENGINE_MB = {
    "plain": 380.4,
    "AC layer1-4": 354.5,
    "AC 8 blocks": 330.5,
    "efficient conv-bn": 314.0,
    "bf16 autocast": 292.5,
}


@dataclass
class Row:
    """One technique combination: checkpointing spec, conv-bn names, bf16 autocast."""

    name: str
    ac: Any = None
    conv_bn: list[str] | None = None
    bf16: bool = False
    quick: bool = True
    result: dict[str, float] = field(default_factory=dict)


def conv_bn_fn() -> Callable[[nn.Module, list[str]], Any] | None:
    # Written by another part of memfit; the rows that need it are skipped with a note if absent.
    if importlib.util.find_spec("memfit.memory.conv_bn") is None:
        return None
    from memfit.memory.conv_bn import apply_efficient_conv_bn_eval

    return apply_efficient_conv_bn_eval


# (model builder, input batch, optimizer factory, rows)
Setup = tuple[Callable[[], nn.Module], torch.Tensor, Callable[..., Any], list[Row]]


def resnet18_setup(quick: bool) -> Setup:
    import torchvision

    def build() -> nn.Module:
        model = torchvision.models.resnet18(num_classes=10).train()
        for m in model.modules():  # frozen BN: statistics fixed, as in detection backbones
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return model

    conv_selective = dict(names=BLOCKS, selective=dict(save_ops=["convolution"]))
    rows = [
        Row("plain"),
        Row("AC layer1-4", ac=LAYERS),
        Row("AC 8 blocks", ac=dict(types=["BasicBlock"])),
        Row("AC every 2nd block", ac=dict(types=["BasicBlock"], every_n=2), quick=False),
        Row("selective AC 8 blocks (save conv)", ac=conv_selective),
        Row("efficient conv-bn", conv_bn=[""]),
        Row("bf16 autocast", bf16=True),
        Row("AC 8 blocks + conv-bn", ac=dict(types=["BasicBlock"]), conv_bn=[""], quick=False),
        Row("AC 8 blocks + bf16", ac=dict(types=["BasicBlock"]), bf16=True, quick=False),
        Row("AC 8 blocks + conv-bn + bf16", ac=dict(types=["BasicBlock"]), conv_bn=[""], bf16=True),
    ]

    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    return build, torch.randn(32, 3, 128, 128), optimizer, rows


def vit_b_setup(quick: bool) -> Setup:
    import timm

    def build() -> nn.Module:
        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=10, drop_path_rate=0.0)

    rows = [
        Row("plain"),
        Row("AC all 12 blocks", ac=dict(types=["Block"])),
        Row("AC every 2nd block", ac=dict(types=["Block"], every_n=2), quick=False),
        Row("selective AC 12 blocks (save GEMM/attention)", ac=dict(types=["Block"], selective=True)),
        Row("bf16 autocast", bf16=True),
        Row("AC all blocks + bf16", ac=dict(types=["Block"]), bf16=True),
    ]

    # SGD momentum as in (a): with AdamW at this small batch the peak falls in the optimizer step
    # (its foreach temporaries), where no activation technique can show.
    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    return build, torch.randn(4 if quick else 8, 3, 224, 224), optimizer, rows


SETUPS = {"resnet18": resnet18_setup, "vit_b16": vit_b_setup}


def tracked_and_timed(step: Callable[[], None], model: nn.Module, optimizer: Any, steps: int,
                      ) -> tuple[MemoryTracker, float]:
    """A warm-up ``step`` (the optimizer state exists from then on), one under memfit's tracker, then the
    median seconds of ``steps`` more without it (shared with benchmarks/optimizer_offload.py)."""
    step()
    with MemoryTracker(model, optimizer) as tracker:
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return tracker, statistics.median(times)


def measure(
    row: Row, build: Callable[[], nn.Module], x: torch.Tensor, make_opt: Callable[..., Any], steps: int
) -> dict[str, float] | str:
    torch.manual_seed(0)
    model = build()
    if row.conv_bn is not None:
        fn = conv_bn_fn()
        if fn is None:
            return "skipped: memfit.memory.conv_bn is not available"
        fn(model, row.conv_bn)
    if row.ac is not None:
        apply_activation_checkpointing(model, row.ac)
    opt = make_opt(model.parameters())
    y = torch.arange(x.shape[0]) % 10

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if row.bf16 else contextlib.nullcontext()
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    tracker, seconds = tracked_and_timed(step, model, opt, steps)
    b = tracker.breakdown
    return {
        "peak_mb": tracker.peak_bytes / MB,
        "parameters_mb": (b["parameters"] + b["buffers"]) / MB,
        "gradients_mb": b["gradients"] / MB,
        "optimizer_state_mb": b["optimizer_state"] / MB,
        "activations_mb": (b["activations"] + b["inputs"]) / MB,
        "step_s": seconds,
    }


def run_setup(name: str, quick: bool, steps: int, out_dir: Path) -> str:
    build, x, make_opt, rows = SETUPS[name](quick)
    rows = [r for r in rows if r.quick or not quick]
    reference = MMENGINE_MB if name == "resnet18" else {}
    results: list[tuple[Row, dict[str, float] | str]] = []
    for row in rows:
        res = measure(row, build, x, make_opt, steps)
        results.append((row, res))
        shown = res if isinstance(res, str) else f"{res['peak_mb']:.1f} MB"
        print(f"  {name}: {row.name}: {shown}", flush=True)
    base = next(r for row, r in results if row.name == "plain")
    assert isinstance(base, dict)

    head = [
        "technique",
        "peak MB (memfit)",
        "MMEngine 0.10.7 MB",
        "params MB",
        "grads MB",
        "optim state MB",
        "activations MB",
        "step time vs plain",
    ]
    lines = [
        f"### {name}, input {tuple(x.shape)}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    csv_rows = []
    for row, res in results:
        ref = reference.get(row.name)
        ref_s = f"{ref:.1f}" if ref is not None else ""
        if isinstance(res, str):
            lines.append(f"| {row.name} | {res} | {ref_s} | | | | | |")
            continue
        ratio = res["step_s"] / base["step_s"]
        lines.append(
            f"| {row.name} | {res['peak_mb']:.1f} | {ref_s} | {res['parameters_mb']:.1f}"
            f" | {res['gradients_mb']:.1f} | {res['optimizer_state_mb']:.1f} | {res['activations_mb']:.1f}"
            f" | {ratio:.2f}x |"
        )
        csv_rows.append(
            {
                "technique": row.name,
                **{k: round(v, 3) for k, v in res.items()},
                "step_time_ratio": round(ratio, 3),
                "mmengine_mb": ref if ref is not None else "",
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"techniques_{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
    chart(name, csv_rows, out_dir / f"techniques_{name}.png")
    return "\n".join(lines)


def chart(name: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars of the breakdown at the peak, with MMEngine's peak as a marker where known."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["parameters_mb", "gradients_mb", "optimizer_state_mb", "activations_mb"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for part in parts:
        vals = [r[part] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=part.removesuffix("_mb").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    refs = [(i, r["mmengine_mb"]) for i, r in enumerate(rows) if r["mmengine_mb"] != ""]
    if refs:
        ax.scatter(
            [i for i, _ in refs],
            [v for _, v in refs],
            marker="_",
            s=600,
            color="black",
            label="MMEngine 0.10.7 peak",
            zorder=3,
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["technique"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peak memory (MB)")
    ax.set_title(f"{name}: peak memory by technique (memfit tracker, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows, smaller ViT batch, 2 timed steps")
    parser.add_argument("--only", choices=sorted(SETUPS), help="run one model only")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 3, quick 2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the CSV and PNG files")
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.quick else 3)
    tables = [run_setup(name, args.quick, steps, args.out) for name in ([args.only] if args.only else SETUPS)]
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
