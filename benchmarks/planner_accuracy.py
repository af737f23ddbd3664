"""Planner accuracy at full size: the predicted per-rank peak against a real CPU run, and the predicted
step-time order of a plan matrix against the measured one.

    python benchmarks/planner_accuracy.py              # full size: several minutes on a 2-core CPU
    python benchmarks/planner_accuracy.py --quick      # 112 px, smaller batches
    python benchmarks/planner_accuracy.py --only vit   # rows whose name contains 'vit' (and no rho)

Peaks: each row is predicted by ``predict(cfg, device=this_cpu(), as_is=True)`` (fake tensors, one
whole step of the configured plan; two ranks over a fake process group) and measured by
``measure_plan`` (memfit's tracker around one real step after a warm-up, what ``memfit bench``
measures). Two-rank rows run under ``memfit.testing.launch`` with gloo
(tests/planner/scripts/measured_peaks.py: rank 0's peak; gloo's reduce-scatter runs as an in-place
all-reduce there, see its docstring). bf16 is measured on ResNet-50 only: this CPU emulates bf16
GEMMs (AVX2), which makes a full-size bf16 ViT or Swin step take minutes.

Step time: ``rho`` is Spearman's rank correlation between the predicted and the measured step time
of ``memfit bench``'s default plan matrix (commands.default_bench_plans) for a ViT-S/16.

Prints a Markdown table and writes ``benchmarks/results/planner_accuracy.csv``. "MB" is 2**20 bytes.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import torch
from torchvision.ops import FrozenBatchNorm2d

from memfit.measure import MB
from memfit.planner.bench import bench, measure_plan
from memfit.planner.commands import default_bench_plans
from memfit.planner.devices import Device, this_cpu
from memfit.planner.fake import build_meta_model
from memfit.planner.predict import predict
from memfit.planner.space import ModelFacts, configured_plan
from memfit.testing import launch, read_results

RESULTS = Path(__file__).parent / "results"
RANK_SCRIPT = Path(__file__).parents[1] / "tests" / "planner" / "scripts" / "measured_peaks.py"


def config(model: dict, image: int, batch: int, precision: str = "fp32", optimizer: str = "AdamW",
           **extra) -> dict:
    """A shapes-dataset training config around ``model`` (``extra``: strategy, techniques)."""
    optim = dict(type="AdamW", lr=1e-3, weight_decay=0.05) if optimizer == "AdamW" else \
        dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-4)
    wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer=optim) if precision == "bf16" else \
        dict(type="OptimWrapper", optimizer=optim)
    data = dict(type="ShapesDataset", image_size=image, num_classes=10, num_samples=64)
    return dict(model=model, optim_wrapper=wrapper, train_cfg=dict(by_epoch=False, max_iters=1),
                train_dataloader=dict(batch_size=batch, num_workers=0, dataset=data,
                                      sampler=dict(type="DefaultSampler", shuffle=False)), **extra)


def resnet50() -> dict:
    return dict(type="ImageClassifier", backbone=dict(type="resnet50", num_classes=10, norm_layer=FrozenBatchNorm2d))


def timm(name: str, image: int) -> dict:
    return dict(type="TimmClassifier", model_name=name, num_classes=10, img_size=image)


def rows(quick: bool) -> tuple[dict[str, dict], dict[str, dict]]:
    """(one-process rows, two-rank rows): name -> config."""
    img, b8, b4 = (112, 4, 2) if quick else (224, 8, 4)
    vit, swin = timm("vit_base_patch16_224", img), timm("swin_base_patch4_window7_224", img)
    conv_bn = dict(efficient_conv_bn_eval=["backbone"])
    block_ac = dict(activation_checkpointing=dict(types=["Block"]))
    selective = dict(activation_checkpointing=dict(types=["SwinTransformerBlock"], selective=True))
    one = {
        f"resnet50 {img} b{b8} frozen-bn conv-bn fp32": config(resnet50(), img, b8, optimizer="SGD", **conv_bn),
        f"resnet50 {img} b{b8} frozen-bn conv-bn bf16": config(resnet50(), img, b8, "bf16", "SGD", **conv_bn),
        f"vit-b/16 {img} b{b8} fp32": config(vit, img, b8),
        f"vit-b/16 {img} b{b8} fp32 ac:blocks": config(vit, img, b8, **block_ac),
        f"swin-b {img} b{b4} fp32 ac:selective": config(swin, img, b4, **selective),
    }
    zero1, fsdp = dict(strategy=dict(type="DDPStrategy", zero=True)), dict(strategy=dict(type="FSDPStrategy"))
    two = {
        f"vit-b/16 {img} b{b4}/rank 2 ranks ddp+zero1": config(vit, img, b4, **zero1),
        f"vit-b/16 {img} b{b4}/rank 2 ranks fsdp": config(vit, img, b4, **fsdp),
        f"vit-b/16 {img} b{b4}/rank 2 ranks fsdp ac:blocks": config(vit, img, b4, **fsdp, **block_ac),
    }
    return one, two


def row(name: str, predicted: int, measured: int, seconds: float) -> dict:
    return {"config": name, "predicted_mb": round(predicted / MB, 1), "measured_mb": round(measured / MB, 1),
            "error_pct": round(100 * (predicted - measured) / measured, 2), "step_seconds": round(seconds, 2)}


def peaks(one: dict[str, dict], two: dict[str, dict], device: Device, work: Path) -> list[dict]:
    out = []
    for name, cfg in one.items():
        cfg = {**cfg, "work_dir": str(work)}
        pred = predict(cfg, device=device, as_is=True).results[0]
        facts = ModelFacts.of(build_meta_model(cfg["model"]))
        real = measure_plan(cfg, configured_plan(cfg, facts, cuda=False), facts, steps=1)
        out.append(row(name, pred.peak_bytes, real.peak_bytes, real.seconds))
        print(f"  {out[-1]}", flush=True)
    if two:
        cases = work / "cases.json"
        cases.write_text(json.dumps({n: {**c, "work_dir": str(work)} for n, c in two.items()}))
        proc = launch(RANK_SCRIPT, nproc=2, args=[str(cases)], out_dir=work / "ranks", timeout=3600)
        measured = read_results(work / "ranks", 2, proc)[0]
        for name, cfg in two.items():
            pred = predict({**cfg, "work_dir": str(work)}, device=device, world_size=2, as_is=True).results[0]
            out.append(row(name, pred.peak_bytes, measured[name]["peak"], measured[name]["seconds"]))
            print(f"  {out[-1]}", flush=True)
    return out


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def step_time_ranks(quick: bool, device: Device, work: Path) -> tuple[float, list[dict]]:
    """rho over memfit bench's default plans for a ViT-S/16, and its rows."""
    img, batch = (64, 8) if quick else (112, 8)
    cfg = {**config(timm("vit_small_patch16_224", img), img, batch), "work_dir": str(work)}
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    plans = default_bench_plans(configured_plan(cfg, facts, cuda=False), facts, device)
    predicted = {r.plan: r.seconds for r in predict(cfg, device=device, verify=False).results}
    measured = bench(cfg, plans, facts, steps=3)
    out = [{"plan": m.plan.name, "predicted_rel_time": round(predicted[m.plan] / predicted[plans[0]], 3),
            "measured_rel_time": round(m.rel_step_time, 3)} for m in measured]
    rho = spearman([predicted[m.plan] for m in measured], [m.seconds for m in measured])
    return rho, out


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in table]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="112 px and smaller batches (rho: 64 px)")
    parser.add_argument("--only", help="rows whose name contains this (skips rho unless it is 'rho')")
    args = parser.parse_args()
    device = this_cpu()
    one, two = rows(args.quick)
    if args.only:
        one = {n: c for n, c in one.items() if args.only in n}
        two = {n: c for n, c in two.items() if args.only in n}
    print(f"device: {device.name}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rho = None
        if not args.only or args.only == "rho":
            # First: the prediction runs its fake steps in forked workers, which cannot run backward
            # once this process has run a fake step itself (as the as-is predictions below do).
            rho, rho_rows = step_time_ranks(args.quick, device, Path(tmp) / "rho")
        table = peaks(one, two, device, Path(tmp))
    if table:
        print("\n" + markdown(table))
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / "planner_accuracy.csv"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        print(f"\nwrote {path}")
    if rho is not None:
        print("\n" + markdown(rho_rows))
        print(f"\nSpearman rho (predicted vs measured step time, {len(rho_rows)} plans): {rho:.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
