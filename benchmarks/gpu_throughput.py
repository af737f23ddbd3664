"""Images per second on one GPU: a plain PyTorch loop, memfit's Runner with the same settings, the Runner
with the planner's fastest plan that fits in the plain loop's memory, and each speed lever alone.

    PYTHONPATH=. python3 benchmarks/gpu_throughput.py                 # one H100: under 5 minutes
    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --compile       # the planner may choose compiled plans
    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --smoke         # on the CPU, tiny models: checks the script

Cases (bf16 autocast, AdamW lr 1e-3, no pretrained weights, drop_path 0): torchvision ResNet-50 at 160 px,
batch 128; timm ViT-B/16 (``vit_base_patch16_224``) and Swin-T (``swin_tiny_patch4_window7_224``) at 224 px,
batch 64. Data: 256 images drawn once and held in memory (a Dataset that only indexes, so the loader is
not the limit), and for ResNet-50 once more memfit's ShapesDataset drawn on the fly by the loader's workers
(plain and Runner only: the loader is the limit there).
Paths:

* ``plain``: the loop a user writes: DataLoader(shuffle, ``num_workers=min(6, cpus)``, ``pin_memory=True``,
  persistent workers), ``x.cuda(non_blocking=True)``, bf16 autocast, ``zero_grad(set_to_none=True)``;
* ``memfit Runner``: ``Runner.from_cfg`` of a config dict with the same settings (ImageClassifier or
  TimmClassifier, AmpOptimWrapper bf16, iteration-based, no checkpoints, no log lines);
* ``memfit planned``: the same config with the plan ``memfit.planner.predict`` recommends for this GPU at
  a budget of the plain loop's ``max_memory_reserved`` plus the CUDA context the planner counts (its plans'
  peaks include it), divided by 1 - the planner's 5% margin (so the plain loop's own plan is allowed; the
  planned path's measured peak checks the prediction), applied with ``Plan.apply`` (compiled plans only
  with ``--compile``);
* ``+lever``: the Runner config with one lever switched on, against the ``memfit Runner`` path: for
  ResNet-50 channels_last, cudnn_benchmark, a fused AdamW; for ViT-B the fused AdamW; in fp32, ``tf32=True``
  (and for ResNet-50 ``tf32=False``) against torch's defaults;
* with ``--compile``, first (``compiled`` cases): ResNet-50 and ViT-B with regional ``compile=True`` alone and with
  the other levers the planner gives them (channels_last and a fused AdamW; a fused AdamW), and those levers with
  the whole model compiled (``compile=dict(regional=False)``), beside plain, Runner and planned paths, the planner
  allowed to choose compiled plans.

A case is skipped, with a line saying so, when the time budget is nearly spent.

Method: all paths of a case live in one process and run in turn, a block of iterations each (plain, Runner,
planned, levers, plain, ...), so they share any drift of the machine; each path's first block (building it,
``--warmup`` steps) is discarded; img/s is a block's images over its synchronised wall time (each block starts
and ends with ``torch.cuda.synchronize``, no sync inside), reported as the median over ``--rounds`` blocks of
``--block`` steps; ratios are medians of per-round ratios. The ShapesDataset case runs its paths one after the
other instead (a paused path's workers would fill their queues and flatter its next block). Memory per path:
peak ``max_memory_allocated`` less what the paused paths hold; ``max_memory_reserved``'s rise over the
warm-up block (exact for the first path, a lower bound for later ones: see throughput_paths.Ledger).

Prints Markdown tables and writes gpu_throughput.csv, .png and .json (all raw numbers) to ``--out``.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from throughput_cases import (  # noqa: E402
    CASES,
    COMPILE_CASES,
    MODELS,
    SMOKE_MODELS,
    Case,
    Spec,
    plain_path,
    runner_cfg,
)
from throughput_paths import Ledger, PathFailed, RunnerPath, backend_flags  # noqa: E402
from throughput_planner import finish_prediction, start_prediction  # noqa: E402
from throughput_report import report  # noqa: E402
from timing import profile_block  # noqa: E402

from memfit.planner.predict import AUTO_FIT_MARGIN  # noqa: E402
from memfit.precision.base import cpu_has_native_bf16  # noqa: E402

RESULTS = Path(__file__).parent / "results"
RESERVE_S = 10.0  # kept for closing paths and writing the results


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a compiled path's warm-up adds its own)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_left(args: argparse.Namespace) -> float:
    return args.budget_s - (time.perf_counter() - T0)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- one case --------------------------------------------------------------------------------------------
def run_case(case: Case, args: argparse.Namespace, plans: dict, flags0: tuple) -> dict:
    models = SMOKE_MODELS if args.smoke else MODELS
    model, cuda = models[case.model], not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    warmup, rounds, block = args.warmup, args.rounds, args.block
    if case.short:
        warmup, rounds, block = max(1, warmup // 2), max(2, rounds - 1), max(1, block // 2)
    if args.smoke and case.dtype == "bf16" and not cpu_has_native_bf16():
        case = replace(case, dtype="fp32")  # emulated bf16 convolutions are ~25x slower than fp32 on such CPUs
    base_cfg = runner_cfg(model, case, args.workers, cuda)
    ledger = Ledger(cuda)
    rec: dict[str, Any] = {"case": case.name, "model": model.label, "dtype": case.dtype, "data": case.data,
                           "interleaved": case.interleave, "warmup_steps": warmup, "block_steps": block, "paths": {}}
    paths: list[Any] = []
    tmp = tempfile.TemporaryDirectory(prefix="memfit-plan-")
    proc = None

    def record(spec: Spec, **kw: Any) -> dict:
        return rec["paths"].setdefault(spec.name, {"path": spec.name, "kind": spec.kind, "base": spec.base,
                                                   "block_s": [], "img_s": [], **kw})

    def warm(spec: Spec, path: Any) -> None:
        r = record(spec, images_per_iter=path.images_per_iter)
        log(f"{case.name}: {spec.name}: building, {warmup} warm-up steps")
        try:
            r["warmup_s"] = round(ledger.run(spec.name, lambda: path.block(warmup), warmup=True), 3)
            r["dynamo_graphs_so_far"] = dynamo_graphs()
            paths.append((spec, path))
        except PathFailed as exc:
            r["error"] = str(exc)
            log(f"{case.name}: {spec.name}: not run: {exc}")
            path.close()
            ledger.drop(spec.name)

    def timed(spec: Spec, path: Any) -> None:
        r = record(spec)
        try:
            seconds = ledger.run(spec.name, lambda: path.block(block), warmup=False)
        except PathFailed as exc:
            r["error"] = str(exc)
            return
        r["block_s"].append(round(seconds, 5))
        r["img_s"].append(round(block * path.images_per_iter / seconds, 2))

    try:
        for spec in case.specs:
            if spec.kind == "plain":
                path = plain_path(model, case, args.workers, device, flags0)
            elif spec.kind == "runner":
                path = RunnerPath(spec.name, spec.edit(base_cfg) if spec.edit else base_cfg, device, flags0)
            else:
                continue
            warm(spec, path)
            if spec.kind == "plain" and any(s.kind == "planned" for s in case.specs) and case.model not in plans:
                from memfit.planner import devices

                # --smoke: plans this CPU runs (an H100's levers would not), every plan for the first model only
                target = devices.current_cuda() if cuda else devices.this_cpu()
                # All of the plain loop's memory: the planner keeps AUTO_FIT_MARGIN of a budget free for its
                # prediction's error, so the budget is scaled up by it; the planned path's measured peak checks it.
                plain = ledger.reserved.get("plain", 0) + devices.CUDA_CONTEXT
                budget = int(plain / (1 - AUTO_FIT_MARGIN)) if cuda else target.memory
                proc = start_prediction(base_cfg, target, budget, args.compile, args.smoke and bool(plans), tmp.name)
                log(f"{case.name}: planning for {target.name} at {budget / 2**30:.2f} GiB (in a child process)")
            if not case.interleave and paths and paths[-1][1] is path:  # its rounds now, then it goes
                if proc is not None:  # not beside the planner's processes
                    plans[case.model] = finish_prediction(proc, tmp.name, time_left(args) - RESERVE_S)
                    proc = None
                for _ in range(rounds):
                    timed(spec, path)
                path.close()
                paths.pop()
                ledger.drop(spec.name)
        planned = next((s for s in case.specs if s.kind == "planned"), None)
        if planned is not None:
            if proc is not None:
                plans[case.model] = finish_prediction(proc, tmp.name, time_left(args) - RESERVE_S)
            chosen = plans.get(case.model, {"error": "no prediction (the plain path failed)"})
            rec["planner"] = {k: v for k, v in chosen.items() if k not in ("plan", "facts")}
            if "plan" in chosen:
                cfg = chosen["plan"].apply(base_cfg, chosen["facts"])
                log(f"{case.name}: planned: {chosen['plan_name']} (predicted in {chosen['predict_s']} s)")
                warm(planned, RunnerPath(planned.name, cfg, device, flags0))
                record(planned)["plan"] = chosen["plan_name"]
                if not case.interleave:
                    for _ in range(rounds):
                        timed(planned, paths[-1][1])
            else:
                record(planned)["error"] = chosen["error"]
                log(f"{case.name}: planned: not run: {chosen['error']}")
        order = {s.name: i for i, s in enumerate(case.specs)}
        paths.sort(key=lambda sp: order[sp[0].name])
        last = 0.0
        for i in range(rounds if case.interleave else 0):
            if time_left(args) < last + RESERVE_S:
                rec["note"] = f"{i} of {rounds} rounds: the time budget ran out"
                log(f"{case.name}: stopping after {i} rounds (time budget)")
                break
            start = time.perf_counter()
            for spec, path in paths:
                timed(spec, path)
            last = time.perf_counter() - start
        for spec, path in paths if args.profile else ():
            if time_left(args) < 2 * last / max(len(paths), 1) + RESERVE_S:
                break
            try:
                prof = record(spec)["profile"] = profile_block(path.block, 3, top=8)
                log(f"{case.name}: {spec.name}: {prof['cuda_ms_per_step']:.1f} ms of kernels a step "
                    f"({prof['kernels_per_step']:.0f} kernels)")
            except PathFailed as exc:
                record(spec)["profile_error"] = str(exc)
    finally:
        log(f"{case.name}: closing {len(paths)} paths")
        for _, path in paths:
            path.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
        tmp.cleanup()
        paths.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for name, r in rec["paths"].items():
        r["max_allocated"] = ledger.allocated.get(name)
        r["max_reserved"] = ledger.reserved.get(name)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, 2-step blocks: checks the script")
    parser.add_argument("--compile", action="store_true", help="let the planner choose compiled plans")
    parser.add_argument("--profile", action="store_true", help="after a case's rounds, 3 steps of each path under "
                        "torch.profiler: CUDA kernel ms per step and the top kernels (in the JSON)")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting work after this many seconds "
                        "(default 270 on a GPU, 90 with --smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="discarded steps per path (default 25)")
    parser.add_argument("--rounds", type=int, default=None, help="timed blocks per path (default 4)")
    parser.add_argument("--block", type=int, default=None, help="steps per timed block (default 15)")
    parser.add_argument("--workers", type=int, default=min(6, os.cpu_count() or 1), help="DataLoader workers")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the CSV, PNG and JSON files")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_throughput.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
        return 2
    small = (1, 2, 2) if args.smoke else (25, 4, 15)
    args.warmup = args.warmup or small[0]
    args.rounds = args.rounds or small[1]
    args.block = args.block or small[2]
    args.budget_s = args.budget_s or (90.0 if args.smoke else 270.0)
    flags0 = backend_flags()
    plans: dict = {}
    records = []
    for case in (COMPILE_CASES if args.compile else []) + CASES:
        if args.only not in case.name:
            continue
        need = case.min_s / (10 if args.smoke else 1)
        if time_left(args) < need + RESERVE_S:
            log(f"{case.name}: skipped: {time_left(args):.0f} s left of the budget, it needs about {need:.0f} s")
            records.append({"case": case.name, "skipped": f"time budget ({time_left(args):.0f} s left)", "paths": {}})
            continue
        try:
            records.append(run_case(case, args, plans, flags0))
        except Exception as exc:  # noqa: BLE001 - one case's failure must not lose the others' numbers
            log(f"{case.name}: failed: {type(exc).__name__}: {exc}")
            records.append({"case": case.name, "error": f"{type(exc).__name__}: {exc}", "paths": {}})
    log("writing the results")
    report(records, args, time.perf_counter() - T0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
