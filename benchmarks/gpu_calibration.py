"""Calibrate the planner's CUDA figures on a real GPU: predicted vs measured allocated, reserved and
device memory per plan, and step-time ratios.

Two halves, so the GPU is held only while it measures:

    python benchmarks/gpu_calibration.py measure --out DIR      # on the GPU: one process per case
    python benchmarks/gpu_calibration.py measure --trace --only 18,19 --out DIR  # + TRACED cases' allocator traces
    python benchmarks/gpu_calibration.py compare [DIR/measured.json] [--composed] [--out PATH_WITHOUT_SUFFIX]

``measure`` runs each case in a fresh process (so the caching allocator starts empty, as a training
run's does) with :func:`memfit.planner.bench.measure_plan`: one warm-up optimizer step, one step whose
``max_memory_allocated``/``max_memory_reserved`` are read, then timed steps. It also reads what the
device holds outside the allocator (``mem_get_info`` used minus ``memory_reserved``: the CUDA context,
cuBLAS/cuDNN handles and their kernels) and the cuBLAS workspace. ``compare`` predicts each case for
the same GPU on fake tensors (no GPU needed) and prints both side by side; by default it reads
benchmarks/gpu_calibration_h100.json, what an H100 measured (torch 2.11, CUDA 13; docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
GIB = 2**30
MIB = 2**20

SWIN_L = ROOT / "configs" / "swin_l_shapes.py"
VIT = ROOT / "configs" / "vit_shapes.py"
FCOS = ROOT / "configs" / "detection" / "fcos_r18_shapes-coco.py"
_TIMM_224 = ["model.img_size=224", "model.patch_size=16", "model.class_token=True", "model.global_pool=token",
             "train_dataloader.dataset.image_size=224"]
VIT_L = ["model.model_name=vit_large_patch16_224", "model.embed_dim=1024", "model.depth=24", "model.num_heads=16",
         "train_dataloader.batch_size=64", *_TIMM_224]
DEIT_B = ["model.model_name=deit_base_patch16_224", "model.embed_dim=768", "model.depth=12", "model.num_heads=12",
          "train_dataloader.batch_size=64", *_TIMM_224]
# (name, config, --cfg-options, plan words or 'configured'; 'dino:N' configs are row N of MMDetection's table)
CASES: list[tuple[str, str, list[str], str]] = [
    ("swin-l fp32", str(SWIN_L), [], "fp32 mb32x1"),
    ("swin-l fp16", str(SWIN_L), [], "fp16 mb32x1"),
    ("swin-l bf16", str(SWIN_L), [], "bf16 mb32x1"),
    ("swin-l bf16 ac:blocks", str(SWIN_L), [], "bf16 ac:blocks mb32x1"),
    ("swin-l bf16 ac:selective", str(SWIN_L), [], "bf16 ac:selective mb32x1"),
    ("swin-l fp16 ac:stages", str(SWIN_L), [], "fp16 ac:stages mb32x1"),
    ("swin-l bf16 mb8x4", str(SWIN_L), [], "bf16 mb8x4"),
    ("swin-l fp16 fsdp (configured, one rank)", str(SWIN_L), [], "configured"),
    ("vit-t fp16 (demo)", str(VIT), [], "configured"),
    ("vit-t fp32 (demo)", str(VIT), [], "fp32 mb32x1"),
    ("fcos-r18 fp32 (demo)", str(FCOS), [], "configured"),
    ("fcos-r18 bf16", str(FCOS), [], "bf16 mb8x1"),
    *[(f"dino swin-l row {i}", f"dino:{i}", [], "configured") for i in (1, 2, 3, 4, 5, 6)],
    # ViT-L/16 at 224 px, batch 64: the composed rows of a 16 GiB budget, each measured as it would train.
    *[(f"vit-l {words}", str(VIT), VIT_L, words) for words in (
        "fp32 mb64x1", "bf16 mb64x1", "bf16 ac:blocks mb64x1", "bf16 ac:every2 mb64x1", "bf16 ac:first2 mb64x1",
        "bf16 ac:selective mb64x1", "bf16 mb32x2", "bf16 ac:blocks mb32x2")],
    ("swin-b bf16 fsdp (one rank)", str(SWIN_L), ["model.model_name=swin_base_patch4_window7_224"], "bf16 fsdp mb32x1"),
    ("deit-b bf16 offload:optimizer", str(VIT), DEIT_B, "bf16 offload:optimizer mb64x1"),
    # FSDP's CPU offload accumulating: the unsharded gradients it keeps while sync is off stay on the device.
    ("deit-b bf16 fsdp offload:params mb32x2 (one rank)", str(VIT), DEIT_B, "bf16 fsdp offload:params mb32x2"),
]
# The cases whose allocator trace ``measure --trace`` records (two steps from an empty allocator).
TRACED = ("vit-l bf16 mb64x1", "vit-l bf16 ac:blocks mb64x1", "vit-l bf16 ac:every2 mb64x1",
          "deit-b bf16 offload:optimizer", "swin-b bf16 fsdp (one rank)")


def _config(spec: str, options: list[str], data: Path) -> dict:
    from memfit.config import Config, parse_cfg_options

    if spec.startswith("dino:"):
        from detection_plan_rows import ROWS, row_config

        switches = next(r[1] for r in ROWS if r[0] == int(spec[5:]))
        return row_config(data, switches)
    cfg = Config.fromfile(spec)
    if "shapes-coco" in spec:
        options = [f"data_root={data}/", f"train_dataloader.dataset.data_root={data}/", *options]
    cfg.merge_from_dict(parse_cfg_options(["train_dataloader.num_workers=0", *options]))
    return cfg.to_dict()


def _plan(cfg: dict, words: str, cuda: bool) -> tuple[Any, Any]:
    from memfit.planner.commands import parse_plan
    from memfit.planner.fake import build_meta_model
    from memfit.planner.space import ModelFacts, configured_plan

    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    return parse_plan(words, configured_plan(cfg, facts, cuda)), facts


def _data(tmp: str) -> Path:
    from memfit.data import write_shapes_coco

    write_shapes_coco(tmp, num=8, image_size=96, split="train")
    return Path(tmp)


def measure_one(index: int, bare: int | None = None) -> dict:
    """Measure case ``index`` on this process's GPU (``bare``: what the device held before this process's first
    case, where it ran others before)."""
    import torch

    from memfit.planner.bench import measure_plan

    name, spec, options, words = CASES[index]
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    bare = total - free if bare is None else bare
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated()
    c = a @ a
    workspace = torch.cuda.memory_allocated() - before - c.numel() * c.element_size()
    del a, c
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(spec, options, _data(tmp))
        plan, facts = _plan(cfg, words, cuda=True)
        torch.cuda.empty_cache()
        m = measure_plan(cfg, plan, facts, steps=int(os.environ.get("MEMFIT_CAL_STEPS", "5")), profile=True)
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    return {"case": name, "plan": plan.name, "device_name": torch.cuda.get_device_name(), "total": total,
            "allocated": m.peak_bytes, "reserved": m.reserved, "outside_allocator": outside,
            "context_bare": bare, "cublas_workspace": workspace, "seconds": m.seconds,
            "times": m.times, "host_times": m.host_times, "profile": m.profile, "breakdown": m.breakdown,
            "torch": torch.__version__}


def measure_several(indices: list[int]) -> None:
    """Measure the cases ``indices`` one after another in this process, each from an empty caching allocator (its
    segments released, the cuBLAS workspaces dropped, the peaks reset: as a fresh process starts), printing one JSON
    line per case (``{"case": ..., "error": ...}`` for one that failed)."""
    import gc
    import time as clock
    import traceback

    import torch
    from allocator_recording import clear_cublas_workspaces

    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    bare = total - free
    for n, i in enumerate(indices):
        start = clock.perf_counter()
        try:
            r = {**measure_one(i, bare), "process": f"{n + 1} of {len(indices)}"}
        except Exception:  # noqa: BLE001 - the case's own error, kept; the next case still runs
            r = {"case": CASES[i][0], "error": traceback.format_exc()[-3000:]}
        r["case_s"] = round(clock.perf_counter() - start, 1)
        print(json.dumps(r), flush=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        clear_cublas_workspaces()
        torch.cuda.reset_peak_memory_stats()


def trace_one(index: int, out: Path, frames: bool = False) -> dict:
    """Record the caching allocator's trace of case ``index`` from an empty allocator: the model built, two
    optimizer steps (the second on the segments the first left; after the steps fp16's loss scaler skips, which
    are recorded too). Written to ``out/trace_<index>.json.gz``
    (rows: action, addr, size, stream; benchmarks/allocator_trace_format.py) with the peaks and the segment
    boundaries of each step; ``frames``: also each allocation of 1 MiB or more's innermost Python frames
    (``frames``: row index -> frames; what makes a block the fake step does not)."""
    import gzip

    import torch
    from allocator_recording import start_recording, stop_recording
    from allocator_trace_format import alloc_frames, compact_trace, device_trace

    from memfit.planner.bench import WARMUP_STEPS, build_for_training, optimizer_state_tensors
    from memfit.planner.inputs import Inputs

    name, spec, options, words = CASES[index]
    torch.zeros(1, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(spec, options, _data(tmp))
        plan, facts = _plan(cfg, words, cuda=True)
        run_cfg = plan.apply(cfg, facts)
        batch = Inputs(run_cfg).batch()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        how = start_recording(2_000_000, frames)
        model, wrapper, _ = build_for_training(run_cfg)
        k = plan.accumulative_counts
        wrapper.initialize_count_status(model, 0, (WARMUP_STEPS + 2) * k)
        marks, after_state = [], 0
        while after_state < 2 and len(marks) < WARMUP_STEPS + 2:  # fp16's scaler may skip the first steps
            for _ in range(k):
                model.train_step(batch, optim_wrapper=wrapper)
            after_state += bool(optimizer_state_tensors(wrapper.optimizer))
            torch.cuda.synchronize()
            marks.append({"trace_len": len(device_trace(torch.cuda.memory._snapshot(), 0)),
                          "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                          "max_allocated": torch.cuda.max_memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved()})
        entries = device_trace(torch.cuda.memory._snapshot(), 0)
        rows, extras, counts = compact_trace(entries)
        named = {"frames": alloc_frames(entries)} if frames else {}
        stop_recording()
    rec = {"case": name, "plan": plan.name, "recording": how, "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(), "steps": marks, "trace": rows, "trace_extras": extras,
           "trace_actions": counts, **named}
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / f"trace_{index}.json.gz", "wt") as f:
        json.dump(rec, f)
    return {"case": name, "rows": len(rows), "steps": marks}


def _child(*args: str, times: int = 1) -> subprocess.CompletedProcess:
    """This script run with ``args`` in a fresh process (an empty caching allocator), within ``times`` x
    ``MEMFIT_CAL_CASE_S`` seconds (default 240); a run past it comes back as exit status 124, with what it
    printed."""
    try:
        return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                              timeout=times * int(os.environ.get("MEMFIT_CAL_CASE_S", "240")),
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess([], 124, out, "timed out")


def case_groups(order: list[int]) -> list[list[int]]:
    """``order`` cut into runs of consecutive cases of one config (the same model and options), each measured in
    one process; DINO's cases each alone (the first compiles the Triton kernel, which a later one would not)."""
    groups: list[list[int]] = []
    for i in order:
        if groups and CASES[groups[-1][-1]][1:3] == CASES[i][1:3] and not CASES[i][1].startswith("dino:"):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def measure(out: Path, only: list[int] | None, trace: list[int] | None = None, group: bool = False) -> None:
    """Measure the cases ``only`` (indices, in that order; default all), after recording the allocator traces of
    the cases ``trace`` (``[]``: the TRACED cases among ``only``; None: none). ``group``: the cases of one config
    (the same model, consecutive in ``only``) in one process (:func:`measure_several`), not one process each."""
    out.mkdir(parents=True, exist_ok=True)
    order = only or list(range(len(CASES)))
    if trace is not None:
        for i in trace or [i for i in order if CASES[i][0] in TRACED]:
            proc = _child("trace", str(i), "--out", str(out))
            print(proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else
                  f"{CASES[i][0]}: trace FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
    results = []
    for indices in case_groups(order) if group else [[i] for i in order]:
        start = time.perf_counter()
        proc = _child("one", *map(str, indices), times=len(indices))
        lines = {json.loads(x)["case"]: json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")}
        for i in indices:
            case, r = CASES[i], lines.get(CASES[i][0])
            if r is None or "error" in r:
                why = r["error"] if r else f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
                print(f"{case[0]}: FAILED {why}", flush=True)
                results.append({"case": case[0], "error": why})
                continue
            # The case's process, whole; grouped, the case's own seconds (its process's start is the first's)
            r["wall_s"] = round(time.perf_counter() - start, 1) if len(indices) == 1 else r["case_s"]
            results.append(r)
            print(f"{r['case']}: allocated {r['allocated'] / GIB:.2f} GiB, reserved {r['reserved'] / GIB:.2f} GiB, "
                  f"outside allocator {r['outside_allocator'] / MIB:.0f} MiB "
                  f"(bare context {r['context_bare'] / MIB:.0f}), cuBLAS workspace "
                  f"{r['cublas_workspace'] / MIB:.1f} MiB, step {r['seconds']:.3f} s "
                  f"(host {statistics.median(r['host_times']):.3f} s) [{r['wall_s']:.0f} s]", flush=True)
        if len(indices) > 1:
            print(f"({len(indices)} cases in one process: {time.perf_counter() - start:.0f} s)", flush=True)
        (out / "measured.json").write_text(json.dumps(results, indent=1))


def compare(measured_path: Path, out: Path, composed: bool) -> None:
    """Each measured case beside its prediction: the plan's own fake step (``--as-is`` on the plan), or
    with ``composed`` the row of a prediction of every plan of its config (how `memfit plan` makes most)."""
    from memfit.errors import ConfigError
    from memfit.planner.devices import GPUS
    from memfit.planner.predict import predict
    from memfit.planner.report import write_csv

    measured = [m for m in json.loads(measured_path.read_text()) if "error" not in m]
    rows, every_plan = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = _data(tmp)
        for m in measured:
            name, spec, options, words = next(c for c in CASES if c[0] == m["case"])
            gpu = next((d for n, d in GPUS.items() if n.split("-")[0] in m["device_name"]), GPUS["H100"])
            cfg = _config(spec, options, data)
            plan, facts = _plan(cfg, words, cuda=True)
            try:
                if composed:
                    key = (spec, tuple(options))
                    if key not in every_plan:  # every plan of the config, the measured ones among them as they ran
                        words_of = [c[3] for c in CASES if (c[1], tuple(c[2])) == key and c[3] != "configured"
                                    and any(x["case"] == c[0] for x in measured)]
                        also = [_plan(cfg, w, cuda=True)[0] for w in words_of]
                        every_plan[key] = predict(cfg, device=gpu, world_size=1, verify=False, also=also).results
                    r = next((r for r in every_plan[key] if replace(r.plan, configured=False) ==
                              replace(plan, configured=False)), None)
                    if r is None:
                        print(f"{name}: {plan.name} is not among the planner's plans", flush=True)
                        continue
                else:
                    r = predict(plan.apply(cfg, facts), device=gpu, world_size=1, as_is=True).results[0]
            except ConfigError as exc:
                print(f"{name}: not predicted: {exc}", flush=True)
                continue
            device_used = m["reserved"] + m["outside_allocator"]
            rows.append({"case": name, "gpu": gpu.name, "plan": plan.name, "source": r.source,
                         "measured_allocated_gib": m["allocated"] / GIB, "predicted_allocated_gib": r.allocated / GIB,
                         "allocated_err_pct": 100 * (r.allocated - m["allocated"]) / m["allocated"],
                         "measured_reserved_gib": m["reserved"] / GIB, "predicted_reserved_gib": r.reserved / GIB,
                         "reserved_err_pct": 100 * (r.reserved - m["reserved"]) / m["reserved"],
                         "reserved_over_allocated": m["reserved"] / m["allocated"],
                         "measured_device_gib": device_used / GIB, "predicted_peak_gib": r.peak_bytes / GIB,
                         "device_err_pct": 100 * (r.peak_bytes - device_used) / device_used,
                         "outside_allocator_mib": m["outside_allocator"] / MIB,
                         "measured_step_s": m["seconds"], "predicted_step_s": r.seconds, **_time_parts(m, r)})
            row = rows[-1]
            print(f"{name}: allocated {row['measured_allocated_gib']:.2f} vs {row['predicted_allocated_gib']:.2f} GiB "
                  f"predicted ({row['allocated_err_pct']:+.1f}%), reserved {row['measured_reserved_gib']:.2f} vs "
                  f"{row['predicted_reserved_gib']:.2f} ({row['reserved_err_pct']:+.1f}%)", flush=True)
    _table(rows)
    print(f"wrote {write_csv(rows, out.with_suffix('.csv'))}")


def _time_parts(m: dict, r: Any) -> dict:
    """A case's step by part, measured (the profiled step's device busy time, the median step's host time until
    its Python returned) beside predicted (the model's kernels, host and offload)."""
    host = statistics.median(m["host_times"]) if m.get("host_times") else None
    out = {"measured_busy_s": (m.get("profile") or {}).get("device_busy_s"), "measured_host_s": host}
    if r.time is not None:
        out.update(predicted_kernels_s=r.time.kernels, predicted_host_s=r.time.host, predicted_offload_s=r.time.offload,
                   predicted_bound=r.time.bound)
    return out


def _table(rows: list[dict]) -> None:
    print("\n| case | plan (source) | allocated GiB meas / pred | err | reserved GiB meas / pred | err "
          "| reserved/allocated | device GiB meas / pred | err | step s meas | step s pred |")
    print("|" + "---|" * 11)
    for r in rows:
        cells = [r["case"], f"{r['plan']} ({r['source']})"]
        for what, pred in (("allocated", "allocated"), ("reserved", "reserved"), ("device", "peak")):
            measured = r["measured_device_gib" if what == "device" else f"measured_{what}_gib"]
            cells += [f"{measured:.2f} / {r[f'predicted_{pred}_gib']:.2f}", f"{r[f'{what}_err_pct']:+.1f}%"]
            if what == "reserved":
                cells.append(f"{r['reserved_over_allocated']:.3f}")
        cells += [f"{r['measured_step_s']:.3f}", f"{r['predicted_step_s']:.3f}"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="on a GPU: measure every case")
    m.add_argument("--out", default="benchmarks/results/gpu_calibration_measured")
    m.add_argument("--only", default="", help="case indices, e.g. 0,3")
    m.add_argument("--group", action="store_true", help="the cases of one config in one process, each from an "
                   "empty allocator (several times faster than a process each)")
    m.add_argument("--trace", nargs="?", const="", default=None,
                   help="first record allocator traces: of these case indices, or bare, of the TRACED cases measured")
    t = sub.add_parser("trace")
    t.add_argument("--frames", action="store_true", help="keep each allocation's Python frames (1 MiB or more)")
    t.add_argument("index", type=int)
    t.add_argument("--out", default="benchmarks/results/gpu_calibration_measured")
    sub.add_parser("workspaces", help="on a GPU: what each kernel family's first call keeps allocated")
    one = sub.add_parser("one")
    one.add_argument("index", type=int, nargs="+")
    c = sub.add_parser("compare", help="predict each measured case and print both")
    c.add_argument("measured", nargs="?", default=str(HERE / "gpu_calibration_h100.json"))
    c.add_argument("--out", default="benchmarks/results/gpu_calibration")
    c.add_argument("--composed", action="store_true", help="predict every plan of each config, compare its rows")
    args = parser.parse_args()
    if args.cmd == "workspaces":
        from kernel_workspaces import workspaces

        for name, nbytes in workspaces().items():
            print(f"{name}: {nbytes / MIB:.2f} MiB left allocated beyond the output")
    elif args.cmd == "one":
        import logging
        import warnings

        logging.getLogger("memfit").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
        if len(args.index) == 1:
            print(json.dumps(measure_one(args.index[0])))
        else:
            measure_several(args.index)
    elif args.cmd == "trace":
        import logging
        import warnings

        logging.getLogger("memfit").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
        print(json.dumps(trace_one(args.index, Path(args.out), args.frames)))
    elif args.cmd == "measure":
        measure(Path(args.out), [int(i) for i in args.only.split(",") if i],
                None if args.trace is None else [int(i) for i in args.trace.split(",") if i], args.group)
    else:
        compare(Path(args.measured), Path(args.out), args.composed)


if __name__ == "__main__":
    main()
