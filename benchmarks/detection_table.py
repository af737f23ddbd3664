"""The seed's DINO Swin-L memory tables (MMDetection projects/example_largemodel) measured on this CPU.

    python benchmarks/detection_table.py                     # all 10 rows, 128 px: 10-15 min on 2 cores
    python benchmarks/detection_table.py --rows 1,3,5 --size 192 --steps 2
    python benchmarks/detection_table.py --predict           # + the planner's peaks at the seed's input size

The model is the seed's config as it is (configs/detection/dino-5scale_swin-l_8xb2-12e_coco.py: DINO,
Swin-L, 5 scales, 900 queries, 80 classes, AdamW, 218M parameters). Only its data changes: the built-in
shapes written as a COCO dataset of ``--size`` px squares (the seed's COCO images are resized to about
1333x800), loaded without augmentation (LoadImageFromFile, LoadAnnotations, PackDetInputs), 2 images per
rank as the seed's 8xb2. 900 queries need 900 feature positions: ``--size`` 128 is the smallest. Each
row's switches come from the row configs beside the seed's: ``activation_checkpointing`` of the FSDP
config (backbone: its ``types``, encoder: its ``names``) and the ``strategy`` of the FSDP and DeepSpeed
configs, FSDP with the seed's units (``wrap_modules``: Swin blocks and encoder layers, as MMDetection's
project wraps ``SwinBlock`` and ``DeformableDetrTransformerEncoderLayer``). AMP is ``AmpOptimWrapper``
with ``dtype='bfloat16'`` (the seed used fp16 on GPUs; both halve the same tensors).

Each row follows ``memfit bench``'s protocol (:func:`memfit.planner.bench.measure_plan`): a fresh model
(seed 0), a warm-up optimizer step so AdamW's state exists, one step under memfit's tracker (peak and
breakdown at the peak), then ``--steps`` timed steps (median). Every measuring process runs one thread
and shares the 2 cores with one other: the one-process rows two at a time, the sharded rows on 2 gloo
ranks (``memfit.testing.launch``); the seed used 8 ranks, so sharded model state here is /2, not /8.
Step time is CPU seconds of the process (the slowest rank's): on a shared machine the wall clock
measures the other users' load too (wall seconds are in the CSV). ``--predict`` adds memfit's planner
(fake tensors, no allocation) at the seed's input size, GPU and rank count for the non-DeepSpeed rows.

Prints the seed's two tables with memfit's numbers beside them and writes ``detection_table.csv`` and
``.png`` under ``--out``. "GB" is 2**30 bytes, as in MMEngine's memory log.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.config import Config
from memfit.data import write_shapes_coco
from memfit.precision.base import cpu_has_native_bf16
from memfit.testing import launch, read_results, write_result

RESULTS = Path(__file__).parent / "results"
CONFIGS = Path(__file__).parents[1] / "configs" / "detection"
SEED_CFG = CONFIGS / "dino-5scale_swin-l_8xb2-12e_coco.py"
FSDP_CFG = CONFIGS / "dino-5scale_swin-l_fsdp_8xb2-12e_coco.py"
DS_CFG = CONFIGS / "dino-5scale_swin-l_deepspeed_8xb2-12e_coco.py"
GB = 2**30
RANKS = 2
BATCH = 2
SEED_RANKS = 8
SEED_INPUT = (1066, 800)  # (w, h): a 4:3 COCO image at the seed's largest training scale (800, 1333)
# The seed's FSDP units (its name_auto_wrap_policy: SwinBlock, DeformableDetrTransformerEncoderLayer).
FSDP_UNITS = ["SwinTransformerBlock", "DeformableEncoderLayer"]


@dataclass(frozen=True)
class Row:
    """A row of the seed's tables: its switches, the seed's peak (GB), iteration time (s) and GPU."""

    id: str
    amp: bool
    gc_backbone: bool
    gc_encoder: bool
    shard: str  # '' | 'fsdp' | 'deepspeed'
    seed_gb: float
    seed_s: float
    seed_gpu: str = "3090"


# Example 1 (FSDP) rows 1-8; Example 2 (DeepSpeed) rows 1, 2, 3, 5 are Example 1's rows 1, 2, 4, 6.
ROWS = [
    Row("1", False, False, False, "", 49, 0.9, "A100-80"),
    Row("2", True, False, False, "", 39, 1.2, "A100-80"),
    Row("3", False, True, False, "", 33, 1.1, "A100-80"),
    Row("4", True, True, False, "", 25, 1.3, "A100-80"),
    Row("5", False, True, True, "", 18, 2.2),
    Row("6", True, True, True, "", 13, 1.6),
    Row("7", False, True, True, "fsdp", 14, 2.9),
    Row("8", True, True, True, "fsdp", 8.5, 2.4),
    Row("ds4", True, True, False, "deepspeed", 10.5, 1.5),
    Row("ds6", True, True, True, "deepspeed", 5.0, 1.4),
]
BY_ID = {r.id: r for r in ROWS}
# Example 2's table: (its ID, the row measured for it, the seed's GB and seconds in Example 2).
EXAMPLE2 = [("1", "1", 49, 0.9), ("2", "2", 39, 1.2), ("3", "4", 25, 1.3), ("4", "ds4", 10.5, 1.5),
            ("5", "6", 13, 1.6), ("6", "ds6", 5.0, 1.4)]


def base_config(data_root: Path, resize: tuple[int, int] | None = None) -> dict:
    """The seed's config with its COCO data swapped for the shapes-coco dataset under ``data_root``
    (``resize``: (w, h) every image is resized to)."""
    cfg = Config.fromfile(SEED_CFG).to_dict()
    pipeline = [dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True)]
    if resize:
        pipeline.append(dict(type="Resize", scale=resize, keep_ratio=False))
    loader = cfg["train_dataloader"]
    loader.update(num_workers=0, persistent_workers=False, sampler=dict(type="DefaultSampler", shuffle=False))
    loader["dataset"].update(data_root=f"{data_root}/", ann_file="annotations/instances_train.json",
                             data_prefix=dict(img="train/"), pipeline=[*pipeline, dict(type="PackDetInputs")])
    for key in ("val_dataloader", "test_dataloader", "val_evaluator", "test_evaluator", "val_cfg", "test_cfg"):
        cfg.pop(key, None)
    cfg["work_dir"] = str(data_root / "work")
    return cfg


def row_config(base: dict, row: Row) -> dict:
    """``base`` with the row's switches, taken from the seed's FSDP and DeepSpeed row configs."""
    fsdp, ds = Config.fromfile(FSDP_CFG).to_dict(), Config.fromfile(DS_CFG).to_dict()
    gc = fsdp["activation_checkpointing"]  # dict(types=['SwinTransformerBlock'], names=['encoder.layers'])
    cfg = {**base, "optim_wrapper": dict(base["optim_wrapper"])}
    if row.amp:
        cfg["optim_wrapper"].update(type="AmpOptimWrapper", dtype="bfloat16")
    spec = {**({"types": gc["types"]} if row.gc_backbone else {}), **({"names": gc["names"]} if row.gc_encoder else {})}
    if spec:
        cfg["activation_checkpointing"] = spec
    if row.shard == "fsdp":
        # The units that gave the seed's numbers. wrap_modules takes precedence over the row config's
        # size-based policy (MMEngine's example), which makes stage 3's 18 Swin blocks one unit.
        cfg["strategy"] = {**fsdp["strategy"], "wrap_modules": FSDP_UNITS}
    elif row.shard:
        cfg["strategy"] = ds["strategy"]
    return cfg


def measure(cfg: dict, steps: int) -> dict[str, Any]:
    """:func:`memfit.planner.bench.measure_plan`'s protocol on ``cfg`` as it is (set up by the runner's own
    code), timing each step by this process's CPU clock beside the wall clock."""
    from memfit.connector import setup
    from memfit.memory.measure import MemoryTracker
    from memfit.optim.builder import scale_lr_cfg
    from memfit.planner.fake import first_batch
    from memfit.planner.space import technique_cfg
    from memfit.precision import precision_options
    from memfit.registry import MODELS
    from memfit.strategies import build_strategy

    torch.manual_seed(0)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    strategy = build_strategy(cfg.get("strategy"))
    model = MODELS.build(cfg["model"], key="model")
    optim_cfg = scale_lr_cfg(cfg["optim_wrapper"], cfg.get("auto_scale_lr"), lambda: BATCH * world)
    model, wrapper = setup(model, strategy, optim_cfg, technique_cfg(cfg),
                           precision=precision_options(cfg.get("precision")))
    model.train()
    batch = first_batch(cfg["train_dataloader"])
    wrapper.initialize_count_status(model, 0, steps + 2)
    model.train_step(batch, optim_wrapper=wrapper)  # warm-up: the optimizer state
    with MemoryTracker(model, wrapper.optimizer, device=strategy.device) as tracker:
        model.train_step(batch, optim_wrapper=wrapper)
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        model.train_step(batch, optim_wrapper=wrapper)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"peak": tracker.peak_bytes, "breakdown": dict(tracker.breakdown), "wall": statistics.median(wall),
            "cpu": statistics.median(cpu)}


def _reduce_scatter_in_place(output: torch.Tensor, input: torch.Tensor, op: Any = None, group: Any = None,
                             async_op: bool = False) -> None:
    """gloo's reduce-scatter copies its whole input in C++, which the tracker sees as a live input for the
    whole step; run it as NCCL allocates: an in-place all-reduce and a copy of this rank's chunk (as
    tests/planner/scripts/measured_peaks.py does for the planner's accuracy runs)."""
    import torch.distributed as tdist

    tdist.all_reduce(input, op=op or tdist.ReduceOp.SUM, group=group)
    rank, world = tdist.get_rank(group), tdist.get_world_size(group)
    output.copy_(input.view(world, -1)[rank].view_as(output))


def worker(data_root: Path, ids: list[str], steps: int, name: str | None) -> None:
    """In a child process: measure ``ids``, write ``{id: result}`` (``name``: a one-process child's file;
    None: a torchrun rank's)."""
    import torch.distributed as tdist

    tdist.reduce_scatter_single = _reduce_scatter_in_place  # FSDP2 looks it up at each call
    base = base_config(data_root)
    write_result({i: measure(row_config(base, BY_ID[i]), steps) for i in ids}, name=name)


def _solo(data_root: Path, groups: list[list[str]], steps: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run each group of one-process rows in its own process, all at once, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMFIT_TEST_OUT": str(out_dir), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, ids in enumerate(groups):
        cmd = [sys.executable, __file__, "--worker", str(data_root), "--name", f"solo{k}_", "--rows", ",".join(ids),
               "--steps", str(steps)]
        with open(out_dir / f"solo{k}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for k, proc in enumerate(procs):
        if proc.wait():
            raise RuntimeError(f"worker {k} failed:\n{(out_dir / f'solo{k}.log').read_text()[-4000:]}")
    return [read_results(out_dir, 1, name=f"solo{k}_")[0] for k in range(len(procs))]


def run_rows(ids: list[str], size: int, steps: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """Measure ``ids``; returns per row id its ranks' results (one for a one-process row). One-process rows
    run two at a time, dealt in snake order so each process gets a mix of cheap and dear rows; sharded
    rows in one 2-rank launch."""
    write_shapes_coco(tmp, num=RANKS * BATCH * 2, image_size=size)
    out: dict[str, list[dict[str, Any]]] = {}
    solo = [i for i in ids if not BY_ID[i].shard]
    if solo:
        start = time.perf_counter()
        groups: list[list[str]] = [[] for _ in range(min(RANKS, len(solo)))]
        for n, i in enumerate(solo):
            lap, pos = divmod(n, len(groups))
            groups[pos if lap % 2 == 0 else len(groups) - 1 - pos].append(i)
        for res in _solo(tmp, groups, steps, tmp / "solo"):
            out.update({i: [r] for i, r in res.items()})
        print(f"  one-process rows {', '.join(solo)}: {time.perf_counter() - start:.0f} s", flush=True)
    sharded = [i for i in ids if BY_ID[i].shard]
    if sharded:
        start = time.perf_counter()
        args = ["--worker", str(tmp), "--rows", ",".join(sharded), "--steps", str(steps)]
        proc = launch(__file__, nproc=RANKS, args=args, out_dir=tmp / "ranks", timeout=3600)
        ranks = read_results(tmp / "ranks", RANKS, proc)
        out.update({i: [r[i] for r in ranks] for i in sharded})
        print(f"  sharded rows {', '.join(sharded)} on {RANKS} ranks: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def predict_seed_size(ids: list[str], tmp: Path) -> dict[str, float]:
    """memfit's planner (a fake-tensor step, ``memfit plan --as-is``) per row at the seed's input size,
    GPU and rank count: GB per rank. DeepSpeed rows are left out (the planner does not run its engine)."""
    from memfit.planner.devices import gpu
    from memfit.planner.predict import predict

    write_shapes_coco(tmp, num=SEED_RANKS * BATCH, image_size=128)
    base = base_config(tmp, resize=SEED_INPUT)
    out = {}
    for i in ids:
        row = BY_ID[i]
        if row.shard == "deepspeed":
            continue
        cfg = row_config(base, row)
        if row.amp:
            cfg["optim_wrapper"]["dtype"] = "float16"  # the seed's; the same bytes as bf16
        res = predict(cfg, device=gpu(row.seed_gpu), world_size=SEED_RANKS if row.shard else 1, as_is=True)
        out[i] = res.results[0].peak_bytes / GB
        print(f"  planner, row {i} at {SEED_INPUT[0]}x{SEED_INPUT[1]} on {row.seed_gpu}: {out[i]:.1f} GB", flush=True)
    return out


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
    """Both seed tables, the seed's numbers beside memfit's, then the breakdown of every row."""
    by_id = {r["id"]: r for r in recs}
    planned = any(r["planner_seed_size_gb"] != "" for r in recs)
    head = ["ID", "AMP", "GC of Backbone", "GC of Encoder", "FSDP", "Peak Mem (GB) seed", "Iter Time ratio seed",
            f"Peak Mem (GB) memfit {size} px, rank 0 / max", "Iter Time ratio memfit"]
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

    out = [f"Example 1 (FSDP): memfit at {size}x{size} px, {BATCH} images/rank; the seed at ~1333x800, 8 GPUs",
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
    planner at the seed's size, when run) beside the seed."""
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
        series.append(("memfit planner, seed's size (GPU)", [
            r["planner_seed_size_gb"] / ref["planner_seed_size_gb"] if r["planner_seed_size_gb"] != "" else 0.0
            for r in recs]))
    series.append(("seed (GPU)", [r["seed_gb"] / ref["seed_gb"] for r in recs]))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=128, help="image side in px, a multiple of 32, >= 128 (128)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per row, median (default 1)")
    parser.add_argument("--rows", default=",".join(BY_ID), help=f"comma-separated ids of {', '.join(BY_ID)} (all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the CSV and PNG")
    parser.add_argument("--predict", action="store_true",
                        help=f"also the planner's peak at {SEED_INPUT[0]}x{SEED_INPUT[1]} on the seed's GPUs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a child process: the data directory
    parser.add_argument("--name", help=argparse.SUPPRESS)  # a one-process child's result file
    args = parser.parse_args(argv)
    ids = [i.strip() for i in args.rows.split(",") if i.strip()]
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; use {', '.join(BY_ID)}")
    if args.size % 32 or args.size < 128:
        parser.error("--size must be a multiple of 32 (Swin's strides) and >= 128 (900 queries need 900 positions)")
    if args.worker:
        worker(args.worker, ids, args.steps, args.name)
        return
    native = cpu_has_native_bf16()
    print(f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}, native bf16: {native}; "
          f"Swin-L DINO at {args.size} px, {BATCH} images/rank, {args.steps} timed step(s); each process "
          f"1 thread, 2 processes at a time", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_rows(ids, args.size, args.steps, Path(tmp) / "measure")
        predicted = predict_seed_size(ids, Path(tmp) / "predict") if args.predict else {}
    recs = table_rows(results, predicted)
    print("\n" + markdown(recs, args.size))
    print(f"\nSharded rows ran on {RANKS} gloo ranks; the seed used {SEED_RANKS}: sharded model state here is "
          f"/{RANKS}, not /{SEED_RANKS}. Iter Time ratio: CPU seconds per step against row {recs[0]['time_base']}.")
    if native:
        print("AMP rows: bf16 autocast on a CPU with native bf16; their times say little about fp16 on a GPU, "
              "their memory holds.")
    else:
        print("AMP rows: this CPU has no native bf16, autocast emulates it: their times are not a GPU's, "
              "their memory holds.")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "detection_table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(recs[0]))
        writer.writeheader()
        writer.writerows(recs)
    chart(recs, args.size, args.out / "detection_table.png")
    print(f"wrote {args.out / 'detection_table.csv'} and .png ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
