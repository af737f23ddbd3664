"""DINO in four precisions on shapes-coco: fp32, AMP bf16, DeepSpeed autocast bf16, DeepSpeed whole-model bf16.

    OMP_NUM_THREADS=1 python benchmarks/detection_precision.py   # 60 steps, batch 4, 64 px (~30 s on an idle core)
    python benchmarks/detection_precision.py --steps 20          # quicker

The tiny DINO of tests/fixtures/detection/dino_tiny.py (Swin embed_dim 32, embed_dims 32, 2 + 2 layers,
20 queries) trains with memfit's Runner on ``memfit.data.write_shapes_coco`` images (written to a temporary
directory, read back by CocoDataset and MMDetection's pipeline) in every mode from the same seed, with the same
data order and AdamW (lr 1e-3, DINO's clip_grad max_norm 0.1):

- ``fp32``: OptimWrapper;
- ``amp_bf16``: AmpOptimWrapper(dtype='bfloat16'): autocast, with DINO's fp32 islands (deformable sampling,
  matching, losses);
- ``ds_autocast_bf16``: DeepSpeedStrategy ZeRO-2 (one process) with AmpOptimWrapper: DeepSpeed's
  torch_autocast, fp32 weights and master weights;
- ``ds_whole_bf16``: DeepSpeedStrategy ZeRO-2 with ``bf16=dict(enabled=True)``: the whole model in bf16
  (DeepSpeed keeps fp32 masters; DINO's losses are fp32 islands). A mode that fails is reported as such.

Prints a Markdown table (final loss: mean of the last 10 steps; mean loss over the curve; the largest
relative difference from fp32 at a step and of the 10-step moving average; median time per step after 3
warm-up steps) and writes ``benchmarks/results/detection_precision.csv`` (the loss curves) and ``.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "detection" / "dino_tiny.py"
ZERO2 = dict(stage=2, reduce_bucket_size=500_000, allgather_bucket_size=500_000)
WINDOW = 10
MODES = {
    "fp32": (dict(type="OptimWrapper"), None),
    "amp_bf16": (dict(type="AmpOptimWrapper", dtype="bfloat16"), None),
    "ds_autocast_bf16": (dict(type="AmpOptimWrapper", dtype="bfloat16"),
                         dict(type="DeepSpeedStrategy", zero_optimization=ZERO2)),
    "ds_whole_bf16": (dict(type="OptimWrapper"),
                      dict(type="DeepSpeedStrategy", zero_optimization=ZERO2, bf16=dict(enabled=True),
                           inputs_to_half=["inputs"])),
}


def train(mode: str, data_root: Path, steps: int, batch_size: int, work_dir: Path) -> dict:
    """One mode's run: the loss of every step and the wall time of each."""
    from memfit.config import Config
    from memfit.hooks.base import Hook
    from memfit.runner import Runner

    class Record(Hook):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            self.start = time.perf_counter()

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            self.losses.append(float(outputs["loss"]))
            self.times.append(time.perf_counter() - self.start)

    wrapper, strategy = MODES[mode]
    record = Record()
    pipeline = [dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True),
                dict(type="PackDetInputs")]
    runner = Runner(
        model=Config.fromfile(FIXTURE).to_dict()["model"], work_dir=str(work_dir / mode), strategy=strategy,
        train_dataloader=dict(
            batch_size=batch_size, num_workers=0, sampler=dict(type="DefaultSampler", shuffle=True),
            collate_fn=dict(type="pseudo_collate"),
            dataset=dict(type="CocoDataset", data_root=str(data_root), ann_file="annotations/instances_train.json",
                         data_prefix=dict(img="train/"), pipeline=pipeline)),
        train_cfg=dict(by_epoch=False, max_iters=steps),
        optim_wrapper=dict(wrapper, optimizer=dict(type="AdamW", lr=1e-3, weight_decay=1e-4),
                           clip_grad=dict(max_norm=0.1)),
        default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=10**6)),
        custom_hooks=[record], randomness=dict(seed=0), log_level="WARNING",
    )
    runner.train()
    return dict(losses=record.losses, times=record.times)


def moving_mean(xs: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def summarise(runs: dict[str, dict | str]) -> list[dict]:
    """One table row per mode, deviations measured against the fp32 run."""
    ref = runs["fp32"]
    rows = []
    for mode, run in runs.items():
        if isinstance(run, str):
            rows.append(dict(mode=mode, note=run))
            continue
        losses, n = run["losses"], min(len(run["losses"]), len(ref["losses"]))
        finite = all(math.isfinite(x) for x in losses)
        dev = max(abs(losses[i] - ref["losses"][i]) / ref["losses"][i] for i in range(n))
        smooth, ref_smooth = moving_mean(losses[:n]), moving_mean(ref["losses"][:n])
        smooth_dev = max(abs(a - b) / b for a, b in zip(smooth, ref_smooth))
        rows.append(dict(mode=mode, final=statistics.fmean(losses[-WINDOW:]), mean=statistics.fmean(losses),
                         dev=dev, smooth_dev=smooth_dev, step_ms=1000 * statistics.median(run["times"][3:]),
                         note="" if finite else "non-finite loss"))
    return rows


def table(rows: list[dict], ref_ms: float) -> str:
    lines = ["| mode | final loss | mean loss | max rel. dev. from fp32 (step) | (10-step mean) | ms / step | "
             "vs fp32 | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "final" not in r:
            lines.append(f"| {r['mode']} | - | - | - | - | - | - | {r['note']} |")
            continue
        lines.append(f"| {r['mode']} | {r['final']:.3f} | {r['mean']:.3f} | {100 * r['dev']:.1f}% | "
                     f"{100 * r['smooth_dev']:.1f}% | {r['step_ms']:.0f} | {r['step_ms'] / ref_ms:.2f}x | "
                     f"{r['note']} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict | str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, run in runs.items():
        if not isinstance(run, str):
            ax.plot(moving_mean(run["losses"]), label=f"{mode} ({WINDOW}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("DINO loss")
    ax.set_title("Tiny DINO on shapes-coco: precision modes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import memfit.model  # noqa: F401  (registers DINO and its parts)
    from memfit.data import write_shapes_coco

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    runs: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_root = Path(tmp) / "shapes_coco"
        write_shapes_coco(data_root, num=args.steps * args.batch_size, image_size=args.image_size, max_shapes=3)
        train("fp32", data_root, 3, args.batch_size, Path(tmp) / "warmup")  # first-run costs (imports, allocator)
        for mode in args.modes.split(","):
            start = time.perf_counter()
            try:
                runs[mode] = train(mode, data_root, args.steps, args.batch_size, Path(tmp) / "work")
            except Exception as exc:  # whole-model bf16 is allowed to fail: record why
                runs[mode] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"{mode}: {time.perf_counter() - start:.1f} s", flush=True)
    rows = summarise(runs)
    ref_ms = next(r["step_ms"] for r in rows if r["mode"] == "fp32")
    print(table(rows, ref_ms))
    args.out.mkdir(parents=True, exist_ok=True)
    curves = {m: r["losses"] for m, r in runs.items() if not isinstance(r, str)}
    with open(args.out / "detection_precision.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *curves])
        for i in range(max(map(len, curves.values()))):
            writer.writerow([i, *(c[i] if i < len(c) else "" for c in curves.values())])
    plot(runs, args.out / "detection_precision.png")
    print(f"wrote {args.out / 'detection_precision.csv'} and .png")


if __name__ == "__main__":
    main()
