"""DINO Swin-L memory tables of MMDetection's large-model example (projects/example_largemodel), measured on this CPU.

    python benchmarks/detection_table.py                     # all 10 rows, 128 px: 10-15 min on 2 cores
    python benchmarks/detection_table.py --rows 1,3,5 --size 192 --steps 2
    python benchmarks/detection_table.py --predict           # + the planner's peaks at MMDetection's input size

The model is the example's config as it is (configs/detection/dino-5scale_swin-l_8xb2-12e_coco.py: DINO,
Swin-L, 5 scales, 900 queries, 80 classes, AdamW, 218M parameters). Only its data changes: the built-in
shapes written as a COCO dataset of ``--size`` px squares (MMDetection's COCO images are resized to
about 1333x800), loaded without augmentation (LoadImageFromFile, LoadAnnotations, PackDetInputs), 2 images per
rank as in its 8xb2. 900 queries need 900 feature positions: ``--size`` 128 is the smallest. Each
row's switches come from the row configs beside the base config: ``activation_checkpointing`` of the FSDP
config (backbone: its ``types``, encoder: its ``names``) and the ``strategy`` of the FSDP and DeepSpeed
configs, FSDP with the example's units (``wrap_modules``: Swin blocks and encoder layers, as MMDetection's
project wraps ``SwinBlock`` and ``DeformableDetrTransformerEncoderLayer``). AMP is ``AmpOptimWrapper``
with ``dtype='bfloat16'`` (MMDetection used fp16 on GPUs; both halve the same tensors).

Each row follows ``memfit bench``'s protocol (:func:`memfit.planner.bench.measure_plan`): a fresh model
(seed 0), a warm-up optimizer step so AdamW's state exists, one step under memfit's tracker (peak and
breakdown at the peak), then ``--steps`` timed steps (median). Every measuring process runs one thread
and shares the 2 cores with one other: the one-process rows two at a time, the sharded rows on 2 gloo
ranks (``memfit.testing.launch``); MMDetection used 8 ranks, so sharded model state here is /2, not /8.
Step time is CPU seconds of the process (the slowest rank's): on a shared machine the wall clock
measures the other users' load too (wall seconds are in the CSV). ``--predict`` adds memfit's planner
(fake tensors, no allocation) at MMDetection's input size, GPU and rank count for the non-DeepSpeed rows.

Prints the example's two tables with memfit's numbers beside them and writes ``detection_table.csv`` and
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
from pathlib import Path
from typing import Any

import torch
from detection_table_report import chart, markdown, table_rows
from detection_table_rows import BATCH, BY_ID, GB, RANKS, SEED_INPUT, SEED_RANKS, base_config, row_config

from memfit.data import write_shapes_coco
from memfit.precision.base import cpu_has_native_bf16
from memfit.testing import launch, read_results, write_result

RESULTS = Path(__file__).parent / "results"


def measure(cfg: dict, steps: int) -> dict[str, Any]:
    """:func:`memfit.planner.bench.measure_plan`'s protocol on ``cfg`` as it is (set up by the runner's own
    code), timing each step by this process's CPU clock beside the wall clock."""
    from memfit.connector import setup
    from memfit.measure import MemoryTracker
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
    """memfit's planner (a fake-tensor step, ``memfit plan --as-is``) per row at MMDetection's input size,
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
            cfg["optim_wrapper"]["dtype"] = "float16"  # MMDetection's; the same bytes as bf16
        res = predict(cfg, device=gpu(row.seed_gpu), world_size=SEED_RANKS if row.shard else 1, as_is=True)
        out[i] = res.results[0].peak_bytes / GB
        print(f"  planner, row {i} at {SEED_INPUT[0]}x{SEED_INPUT[1]} on {row.seed_gpu}: {out[i]:.1f} GB", flush=True)
    return out



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=128, help="image side in px, a multiple of 32, >= 128 (128)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per row, median (default 1)")
    parser.add_argument("--rows", default=",".join(BY_ID), help=f"comma-separated ids of {', '.join(BY_ID)} (all)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the CSV and PNG")
    parser.add_argument("--predict", action="store_true",
                        help=f"also the planner's peak at {SEED_INPUT[0]}x{SEED_INPUT[1]} on MMDetection's GPUs")
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
    print(f"\nSharded rows ran on {RANKS} gloo ranks; MMDetection used {SEED_RANKS}: sharded model state here is "
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
