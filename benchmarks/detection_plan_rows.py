"""The planner's prediction of MMDetection's DINO Swin-L memory table, at full size, beside its numbers.

MMDetection's projects/example_largemodel measured DINO Swin-L (8 GPUs x 2 images, 1333x800) with every
combination of AMP, checkpointing of the backbone and of the encoder, and FSDP. This script runs
`memfit plan --as-is` for each row of that table on fake tensors (no GPU): the configured train step of
configs/detection/dino-5scale_swin-l_8xb2-12e_coco.py with the row's switches, 8 fake ranks, a batch of two
1333x800 images (the size MMDetection's table was measured at; its multi-scale pipeline can make larger
batches, which `memfit plan` on the config itself plans for: docs/planner.md), for an A100-80 (rows 1-4,
where MMDetection ran out of 24 GB) and a 3090 (rows 5-8). It prints the predicted allocated/reserved peak per
rank beside MMDetection's "Peak Mem" (MMEngine logs torch.cuda.max_memory_allocated in MiB, so GB here are GiB) and the
predicted step time relative to row 1 beside MMDetection's iteration times.

    python benchmarks/detection_plan_rows.py [--rows 1,2,...] [--out benchmarks/results/detection_plan_rows]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from memfit.config import Config, parse_cfg_options
from memfit.data import write_shapes_coco
from memfit.planner.devices import gpu
from memfit.planner.predict import predict
from memfit.planner.report import write_csv

CONFIG = Path(__file__).parents[1] / "configs" / "detection" / "dino-5scale_swin-l_8xb2-12e_coco.py"
# MMEngine logs max_memory_allocated / 2**20 as "memory" (MB), so MMDetection's "GB" are GiB.
GIB = 2**30
AMP, GC_BACKBONE, GC_ENCODER, FSDP = "amp", "gc_backbone", "gc_encoder", "fsdp"
# (id, switches, MMDetection's peak GB, its iteration time s, GPU it measured on)
ROWS = [
    (1, (), 49, 0.9, "A100-80"),
    (2, (AMP,), 39, 1.2, "A100-80"),
    (3, (GC_BACKBONE,), 33, 1.1, "A100-80"),
    (4, (AMP, GC_BACKBONE), 25, 1.3, "A100-80"),
    (5, (GC_BACKBONE, GC_ENCODER), 18, 2.2, "3090"),
    (6, (AMP, GC_BACKBONE, GC_ENCODER), 13, 1.6, "3090"),
    (7, (GC_BACKBONE, GC_ENCODER, FSDP), 14, 2.9, "3090"),
    (8, (AMP, GC_BACKBONE, GC_ENCODER, FSDP), 8.5, 2.4, "3090"),
]
FULL_SIZE = ("[dict(type='LoadImageFromFile'),dict(type='LoadAnnotations',with_bbox=True),"
             "dict(type='Resize',scale=(1333,800),keep_ratio=False),dict(type='PackDetInputs')]")


def row_options(switches: tuple[str, ...]) -> list[str]:
    """The row's switches as `memfit train --cfg-options` lines (docs/detection.md lists the same)."""
    opts = []
    if AMP in switches:
        opts.append("optim_wrapper.type=AmpOptimWrapper")
    if GC_BACKBONE in switches:
        opts.append("activation_checkpointing.types=[SwinTransformerBlock]")
    if GC_ENCODER in switches:
        opts.append("activation_checkpointing.names=[encoder.layers]")
    if FSDP in switches:
        opts.append("strategy.type=FSDPStrategy")
    return opts


FSDP_CONFIG = CONFIG.with_name("dino-5scale_swin-l_fsdp_8xb2-12e_coco.py")


def row_config(data: Path, switches: tuple[str, ...]) -> dict:
    cfg = Config.fromfile(CONFIG)
    cfg.merge_from_dict(parse_cfg_options([
        f"train_dataloader.dataset.data_root={data}/",
        "train_dataloader.dataset.ann_file=annotations/instances_train.json",
        "train_dataloader.dataset.data_prefix.img=train/", "train_dataloader.num_workers=0",
        f"train_dataloader.dataset.pipeline={FULL_SIZE}", *row_options(switches)]))
    if FSDP in switches:  # per-block units, as the FSDP config (and MMDetection's project) has them
        cfg.strategy = Config.fromfile(FSDP_CONFIG).strategy
    return cfg.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(r[0]) for r in ROWS), help="row ids, e.g. 1,5,8")
    parser.add_argument("--out", default="benchmarks/results/detection_plan_rows", help="CSV path without suffix")
    args = parser.parse_args()
    wanted = {int(r) for r in args.rows.split(",")}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        write_shapes_coco(tmp, num=4, image_size=96, split="train")
        for rid, switches, seed_gb, seed_s, device_name in ROWS:
            if rid not in wanted:
                continue
            start = time.perf_counter()
            pred = predict(row_config(Path(tmp), switches), device=gpu(device_name), world_size=8, as_is=True)
            r = pred.results[0]
            out.append(dict(id=rid, switches="+".join(switches) or "plain", gpu=device_name, seed_gb=seed_gb,
                            allocated_gb=r.allocated / GIB, reserved_gb=r.reserved / GIB,
                            peak_gb=r.peak_bytes / GIB, seconds=r.seconds, seed_s=seed_s,
                            planned_s=time.perf_counter() - start))
            print(f"row {rid}: {out[-1]['allocated_gb']:.1f} GB allocated (MMDetection {seed_gb} GB) "
                  f"in {out[-1]['planned_s']:.0f} s", flush=True)
    base = next((o for o in out if o["id"] == 1), out[0])
    print("\n| ID | AMP | GC of Backbone | GC of Encoder | FSDP | MMDetection Peak Mem (GB) | predicted allocated (GB) "
          "| error | predicted reserved (GB) | MMDetection iter time (ratio) | predicted step time (ratio) |")
    print("|" + "---|" * 11)
    for o in out:
        on = [("√" if s in o["switches"].split("+") else "") for s in (AMP, GC_BACKBONE, GC_ENCODER, FSDP)]
        err = 100 * (o["allocated_gb"] - o["seed_gb"]) / o["seed_gb"]
        print(f"| {o['id']} | {' | '.join(on)} | {o['seed_gb']} ({o['gpu']}) | {o['allocated_gb']:.1f} | {err:+.0f}% "
              f"| {o['reserved_gb']:.1f} | {o['seed_s'] / base['seed_s']:.2f} | {o['seconds'] / base['seconds']:.2f} |")
    print(f"\nwrote {write_csv(out, Path(args.out).with_suffix('.csv'))}")


if __name__ == "__main__":
    main()
