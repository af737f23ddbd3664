"""Record the CUDA caching allocator's real traces of a few training steps, as small test fixtures.

    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR              # one GPU: under 2 minutes
    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR --only vit   # cases whose name has 'vit'
    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR --dry        # CPU: checks the script

What it records. Each case is a memfit Runner built from a config dict (as a user writes it, and as the
planner's fake step runs it), trained for ``--steps`` (3) iterations on in-memory random images, bf16
autocast (AmpOptimWrapper), AdamW lr 1e-3, no pretrained weights, drop_path 0, no validation, no
checkpoints and no LoggerHook (its line at an epoch's last iteration resets the peak statistics),
``num_workers=0``, seed 0:

* ``vit_s16``: timm ``vit_small_patch16_224``, batch 32, 224 px;
* ``swin_t``: timm ``swin_tiny_patch4_window7_224``, batch 16, 224 px;
* ``resnet50``: torchvision ``resnet50``, batch 64, 160 px (ImageClassifier);
* ``vit_s16_ac_blocks``: ``vit_s16`` with ``cfg=dict(activation_checkpointing=dict(types=['Block']))`` (memfit's
  checkpointing of every timm ViT block, as the planner's 'blocks' plan sets it);
* ``vit_s16_optimizer_offload``: ``vit_s16`` with ``cfg=dict(optimizer_offload=True)`` (AdamW state and step on
  the host; the pinned host buffers are not in the device trace);
* ``vit_s16_fsdp``: ``vit_s16`` with ``strategy=dict(type='FSDPStrategy')`` (FSDP2 ``fully_shard`` per block) on a
  one-rank group that memfit makes itself (``dist.ensure_process_group``: nccl, rank 0, world size 1, an
  in-memory store); FSDP2's all-gathers and reduce-scatters allocate on their own streams, so its entries
  carry streams other than the default one (so do the loader's: memfit's prefetcher copies each next batch on
  a side stream of its own in every case). Run last; the process group is destroyed after it.

How recording starts and the allocator's settings: benchmarks/allocator_recording.py; the file it writes (format,
keys, how a replay test reads it): benchmarks/allocator_trace_format.py; the cases' models and Runner configs:
benchmarks/allocator_trace_cases.py.

Size and time: unknown until run on a GPU. The cases are sized for a file of a few MiB (target < 5 MiB
gzipped; ``--max-entries`` caps each case) and for about a minute on one H100; the budget (``--budget-s``, 110
s) skips the remaining cases, with a line saying so, when too little is left. One line per case is printed:
trace rows, allocs, segment_allocs, streams, peak allocated/reserved in MiB, final segments, seconds (and a
warning where ``checks`` fail). Without CUDA the script exits 2 with one line, unless
``--dry``: then every case is built on the CPU (tiny models: ViT-Ti at 32 px, 2 Swin stages at 64 px,
ResNet-18 at 32 px, batch 2; FSDP on a one-rank gloo group) and trained for one step without recording, and
the file's serialisation is exercised on a synthetic snapshot shaped as torch documents it; the file is
``allocator_traces_dry.json.gz`` then.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.perf_counter()
if "--dry" in sys.argv[1:]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine: set before torch can start CUDA

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from allocator_recording import ALLOC_ENV, Recorder, allocator_backend, ensure_no_expandable_segments  # noqa: E402
from allocator_trace_cases import CASES, DRY_MODELS, MODELS, Case, runner_cfg  # noqa: E402
from allocator_trace_format import (  # noqa: E402
    BLOCK_FIELDS,
    FORMAT_VERSION,
    MIB,
    SEGMENT_COUNT_KEYS,
    TRACE_FIELDS,
    compact_trace,
    jsonable,
    synthetic_check,
    trace_checks,
    write,
)

RESERVE_S = 6.0  # kept for writing the file


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- one case ----------------------------------------------------------------------------------------------
def environment(cuda: bool) -> dict:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        env["cudnn"] = None
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=torch.cuda.get_device_name(), gpu_memory=int(props.total_memory),
                   capability=f"{props.major}.{props.minor}")
        try:
            env["nccl"] = jsonable(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            env["nccl"] = None
    for mod in ("timm", "torchvision"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    from memfit._version import __version__

    env["memfit"] = __version__
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True,
                                           capture_output=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def run_case(case: Case, args: argparse.Namespace, env: dict) -> dict:
    from memfit.runner import Runner

    cuda = not args.dry
    model = (DRY_MODELS if args.dry else MODELS)[case.model]
    steps = 1 if args.dry else args.steps
    dtype = "bfloat16"  # on the CPU too (--dry): tiny models, and the same precision code paths
    start = time.perf_counter()
    hook = Recorder(steps, cuda, args.max_entries)
    rec: dict[str, Any] = {"name": case.name, "description": case.description,
                           "config": {"model": model.label, "model_name": model.name, "image_size": model.size,
                                      "batch": model.batch, "steps": steps, "precision": f"{dtype} autocast",
                                      "optimizer": "AdamW lr 1e-3", "techniques": jsonable(case.techniques),
                                      "strategy": jsonable(case.strategy) or "SingleDeviceStrategy"},
                           "torch": env.get("torch"), "cuda": env.get("cuda"), "gpu": env.get("gpu")}
    with tempfile.TemporaryDirectory(prefix="memfit-traces-") as work_dir:
        cfg = runner_cfg(case, model, steps, cuda, dtype, work_dir, hook)
        rec["runner_cfg"] = jsonable({k: v for k, v in cfg.items() if k not in ("work_dir", "custom_hooks")})
        runner = None
        try:
            torch.manual_seed(0)
            runner = Runner.from_cfg(cfg)
            runner.train()
        finally:
            hook.stop()
            del runner
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    if hook.iters != steps:
        raise RuntimeError(f"the Runner ran {hook.iters} iterations, {steps} expected")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    rec["built"] = hook.built
    if not cuda:
        return rec
    if not hook.final:
        raise RuntimeError(f"recording did not finish: {len(hook.marks)} of {steps} iterations marked")
    rows, extras, counts = compact_trace(hook.final["entries"])
    stats = hook.final["memory_stats"]
    rec.update(initial=hook.initial, trace=rows, trace_extras=extras, trace_actions=counts,
               trace_truncated=len(rows) >= args.max_entries, recording=hook.how, cublas_cleared=hook.cublas_cleared,
               steps=hook.marks, final_segments=hook.marks[-1]["segments"], peaks=hook.final["peaks"],
               segment_counts={k: stats.get(k) for k in SEGMENT_COUNT_KEYS}, memory_stats=stats)
    try:
        rec["checks"] = trace_checks(rec)
    except Exception as exc:  # noqa: BLE001 - the recording itself is kept
        rec["checks"] = {"reserved_ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return rec


def destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        log(f"destroying the process group failed: {exc}")


def summary(rec: dict) -> str:
    if "error" in rec:
        return f"{rec['name']}: FAILED: {rec['error']}"
    if "skipped" in rec:
        return f"{rec['name']}: skipped: {rec['skipped']}"
    if "trace" not in rec:
        return (f"{rec['name']}: ran {rec['config']['steps']} step(s) without recording, {rec['seconds']:.1f} s; "
                f"built: {json.dumps(rec['built'])}")
    a = rec["trace_actions"]
    p = rec["peaks"]
    more = ", TRUNCATED (ring buffer full)" if rec["trace_truncated"] else ""
    more += "" if rec["checks"]["reserved_ok"] else ", reserved bytes from the trace DIFFER from torch's counters"
    streams = len({r[3] for r in rec["trace"]})
    return (f"{rec['name']}: {len(rec['trace'])} trace entries ({a.get('alloc', 0)} alloc, "
            f"{a.get('segment_alloc', 0)} segment_alloc, {streams} streams{more}), peak allocated "
            f"{p['max_memory_allocated'] / MIB:.1f} MiB, reserved {p['max_memory_reserved'] / MIB:.1f} MiB, "
            f"{len(rec['final_segments'])} segments, {rec['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for allocator_traces.json.gz")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--budget-s", type=float, default=110.0, help="start no case after this many seconds "
                        "less the case's estimate (default 110)")
    parser.add_argument("--steps", type=int, default=3, help="iterations recorded per case (default 3)")
    parser.add_argument("--max-entries", type=int, default=400_000, help="torch's ring buffer of trace entries "
                        "per case (default 400000; a case that fills it is marked trace_truncated)")
    parser.add_argument("--dry", action="store_true", help="CPU: build every case, one step each, no recording")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("record_allocator_traces.py needs a CUDA GPU (or --dry for a CPU check of the script)")
        return 2
    cuda = not args.dry
    turned_off = ensure_no_expandable_segments(log) if cuda else False
    if cuda and allocator_backend() not in (None, "native"):
        print(f"record_allocator_traces.py needs torch's native caching allocator, not {allocator_backend()!r} "
              "(unset backend: in PYTORCH_CUDA_ALLOC_CONF)")
        return 2
    env = environment(cuda)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("allocator_traces_dry.json.gz" if args.dry else "allocator_traces.json.gz")
    doc: dict[str, Any] = {
        "format": "memfit.allocator_traces", "format_version": FORMAT_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)], "dry": args.dry,
        "env": env,
        "allocator": {"backend": allocator_backend() if cuda else None,
                      "env": {k: os.environ.get(k) for k in ALLOC_ENV}, "expandable_segments": False,
                      "expandable_segments_turned_off": turned_off, "recording": None,
                      "max_entries": args.max_entries},
        "trace_fields": list(TRACE_FIELDS), "block_fields": list(BLOCK_FIELDS), "cases": []}
    log(f"torch {env['torch']}, CUDA {env['cuda']}, {env.get('gpu') or 'CPU (--dry)'}; writing {path}")
    if args.dry:  # the serialisation on a snapshot shaped as torch documents it
        doc["synthetic_check"] = synthetic_check()
    cases = [c for c in CASES if args.only in c.name]
    if not cases:
        print(f"no case's name contains {args.only!r}: {', '.join(c.name for c in CASES)}")
        return 2
    for case in cases:
        left = args.budget_s - (time.perf_counter() - T0)
        need = case.est_s / (3 if args.dry else 1)
        if left < need + RESERVE_S:
            rec = {"name": case.name, "skipped": f"time budget: {left:.0f} s left, the case needs about {need:.0f} s"}
        else:
            try:
                rec = run_case(case, args, env)
            except Exception as exc:  # noqa: BLE001 - one case's failure must not lose the others
                rec = {"name": case.name, "error": f"{type(exc).__name__}: {str(exc).strip()[:2000]}",
                       "traceback": traceback.format_exc()[-6000:]}
            finally:
                if case.strategy:
                    destroy_group()
        print(summary(rec), flush=True)
        if rec.get("recording"):
            doc["allocator"]["recording"] = rec["recording"]
        if any(s.get("is_expandable") for s in rec.get("final_segments", [])):
            doc["allocator"]["expandable_segments"] = True
        doc["cases"].append(rec)
        doc["seconds"] = round(time.perf_counter() - T0, 1)
        size = write(doc, path)
    ok = sum("error" not in r and "skipped" not in r for r in doc["cases"])
    done = "run" if args.dry else "recorded"
    print(f"{ok} of {len(doc['cases'])} cases {done} in {doc['seconds']:.0f} s; {path}: {size / MIB:.2f} MiB gzipped",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
