"""Where the time of one warm DINO Swin-L training step goes, for each row of MMDetection's large-model table.

Each row of benchmarks/detection_plan_rows.py (default 1-6: one process, no FSDP) is its config (DINO Swin-L,
two 1333x800 images, the row's AMP and checkpointing switches) set up with the calls of
memfit.planner.bench.measure_plan (build_strategy, MODELS.build, memfit.connector.setup), trained for 2 warm-up
steps (more until AdamW's state exists: fp16's GradScaler skips DINO's first steps), timed for one step, then
profiled with torch.profiler for ``--steps`` steps. Per row (and ``--impl`` of the deformable sampling) it prints
the step's wall time, the top operators by self device time (CUDA: the kernels an operator launched; CPU: self
CPU time) with their share of the step, and each part's time, forward and backward: backbone, neck, encoder,
decoder, deformable sampling, head (the branches on the decoder's output), losses, matching, optimizer (step with
clipping and the grad scaler, zero_grad) and other (data preprocessor, positional encodings, query selection,
denoising queries, the loss sum, gradient accumulation into the leaves, kernels linked to no operator).

Each operator counts once, in its innermost part, so the shares sum to 100%: the deformable sampling
(``memfit::ms_deform_attn*`` or the grid_sample path; forward, backward, recompute) is NOT in the encoder's and
decoder's lines; its line says how it splits between them. Matching's line is its device time (the cost
matrices), with its host wall time beside it (copy to the host, linear_sum_assignment; after a device sync).

Attribution. The forward is marked with ``record_function`` ranges, from forward pre-/post-hooks of ``backbone``,
``neck``, ``encoder``, ``decoder``, ``bbox_head`` and by wrapping ``multi_scale_deformable_attn``,
``HungarianAssigner.assign_layers``, ``bbox_head.loss`` and the wrapper's ``step``/``zero_grad`` (all undone
after profiling). There are no backward hooks (full backward hooks put autograd functions around a module's
inputs and outputs, and see nothing of the backbone's list of feature maps): the backward goes through the
profiler's forward/backward link. Each ``autograd::engine::evaluate_function: <Node>`` event carries the
sequence number and thread of the forward operator that made the node, whose part gets the node's operators.
Non-reentrant checkpointing recomputes inside such a node: a recompute counts as its part's backward. The
losses and gradients are those of an unmarked step (tests/benchmarks/test_detection_profile.py checks it).

On the GPU slot (one H100: ~2-2.5 min for rows 1-6, ~20 s a row: building Swin-L, 3-4 steps of ~1 s, the profiled
step, 5-8 s parsing its trace; Triton compiles in the first rows). The second line profiles grid_sample on rows
1-2, beside the first run's Triton kernel (~45 s):

    python -u benchmarks/detection_profile.py --out $OUT/detection_profile
    python -u benchmarks/detection_profile.py --rows 1,2 --impl pytorch --out $OUT/detection_profile_pytorch

On a CPU, the tiny DINO of tests/fixtures/detection/dino_tiny.py at 96x64 px (seconds a row):

    python benchmarks/detection_profile.py --tiny --device cpu --rows 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import runpy
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).parent
TINY = HERE.parent / "tests" / "fixtures" / "detection" / "dino_tiny.py"
TINY_SCALE = (96, 64)  # (w, h) of the --tiny images
MODULE_PARTS = {"backbone": "backbone", "neck": "neck", "encoder": "encoder", "decoder": "decoder", "head": "bbox_head"}
PARTS = ("backbone", "neck", "encoder", "decoder", "sampling", "head", "losses", "matching", "optimizer", "other")
LABELS = {"sampling": "deformable sampling*", "head": "head (branches)", "matching": "matching (Hungarian)",
          "optimizer": "optimizer (step, clip, zero_grad)"}
RANGE = "memfit.part::"
EVAL = "autograd::engine::evaluate_function: "
SAMPLING_OPS = ("memfit::ms_deform_attn", "GeneratedBackwardFor_memfit_ms_deform_attn",  # the op, its Function
                "aten::grid_sampler", "aten::cudnn_grid_sampler")
SAMPLING_KERNELS = ("msda_",)  # memfit's Triton kernels (deform_kernel.msda_forward/backward)


@contextlib.contextmanager
def part_markers(model: torch.nn.Module, wrapper: Any, sync: Callable[[], None]) -> Iterator[dict]:
    """Mark the parts' forward with profiler ranges (see the module docstring); yields the matcher's host
    times ``matching_s``/``wait_s``/``calls``, filled as it runs."""
    from memfit.model.detection.dino import attention
    from memfit.model.detection.dino.matcher import HungarianAssigner

    net = getattr(model, "module", model)
    host = {"matching_s": 0.0, "wait_s": 0.0, "calls": 0}

    def marked(name: str, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            with record_function(RANGE + name):
                return fn(*args, **kwargs)
        return run

    def assign_layers(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        sync()  # the copy to the host would wait for the queued forward: wait here, outside the timed part
        ready = time.perf_counter()
        with record_function(RANGE + "matching"):
            out = assign(self, *args, **kwargs)
        host["wait_s"] += ready - start
        host["matching_s"] += time.perf_counter() - ready
        host["calls"] += 1
        return out

    handles = []
    for part, attr in MODULE_PARTS.items():
        stack: list = []

        def enter(module: Any, args: Any, name: str = part, stack: list = stack) -> None:
            stack.append(record_function(RANGE + name).__enter__())

        def leave(module: Any, args: Any, out: Any, stack: list = stack) -> None:
            stack.pop().__exit__(None, None, None)

        module = getattr(net, attr)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    assign, sample = HungarianAssigner.assign_layers, attention.multi_scale_deformable_attn
    HungarianAssigner.assign_layers = assign_layers
    attention.multi_scale_deformable_attn = marked("sampling", sample)
    net.bbox_head.loss = marked("losses", net.bbox_head.loss)
    wrapper.step, wrapper.zero_grad = marked("optimizer", wrapper.step), marked("optimizer", wrapper.zero_grad)
    try:
        yield host
    finally:
        for h in handles:
            h.remove()
        HungarianAssigner.assign_layers, attention.multi_scale_deformable_attn = assign, sample
        del net.bbox_head.loss, wrapper.step, wrapper.zero_grad


def _owners(cpu_events: list) -> Callable[[Any], tuple[str | None, bool, str | None]]:
    """``owner(event)`` -> (its innermost part or None, whether it ran in the backward, the part around that
    part): the nearest enclosing part range or sampling operator, and for a backward node's event the part of
    the forward operator that made the node (linked by thread and sequence number)."""
    forward, by_seq = {}, defaultdict(list)
    for e in cpu_events:
        if e.sequence_nr >= 0 and not e.name.startswith(EVAL):
            forward.setdefault((e.thread, e.sequence_nr), e)
            by_seq[e.sequence_nr].append(e)
    memo, nothing = {}, (None, False, None)

    def owner(e: Any) -> tuple[str | None, bool, str | None]:
        if e is None or id(e) in memo:
            return nothing if e is None else memo[id(e)]
        memo[id(e)] = nothing  # a cycle (never expected) ends here
        name = e.name
        part = name[len(RANGE):] if name.startswith(RANGE) else "sampling" if name.startswith(SAMPLING_OPS) else None
        if part:
            up = owner(e.cpu_parent)
            result = (part, up[1], up[0] if up[0] != part else up[2])
        elif name.startswith(EVAL):
            made_by = forward.get((e.fwd_thread, e.sequence_nr)) if e.sequence_nr >= 0 else None
            if made_by is None and e.sequence_nr >= 0:  # thread ids that do not match: any other thread's op
                made_by = next((f for f in by_seq.get(e.sequence_nr, ()) if f.thread != e.thread), None)
            got = owner(made_by)
            if got[0] is None:
                got = owner(e.cpu_parent)
            result = (got[0], True, got[2])
        else:
            result = owner(e.cpu_parent)
        memo[id(e)] = result
        return result

    return owner


def attribute(events: list, cuda: bool, steps: int) -> dict:
    """Per part forward/backward microseconds, the sampling's split by enclosing part, per operator time and
    calls, the sampling operators found and the total, per step, from the profiler's ``events``."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    owner = _owners(cpu)
    parts = {p: [0.0, 0.0] for p in PARTS}
    sampling_in, found, linked = Counter(), Counter(), Counter()
    ops: dict[str, dict] = defaultdict(lambda: {"calls": 0, "us": 0.0, "parts": Counter()})
    for e in cpu:
        if e.name.startswith(SAMPLING_OPS):
            found[e.name] += 1
        if e.name.startswith(RANGE):
            continue  # a marker, not an operator (on a CPU its self time is Python between operators, kept below)
        ops[e.name]["calls"] += 1
    for e in cpu:
        us = sum(k.duration for k in e.kernels) if cuda else e.self_cpu_time_total
        for k in e.kernels if cuda else ():
            linked[k.name] += k.duration
        if not us:
            continue
        part, backward, outer = owner(e)
        part = part or "other"
        parts[part][backward] += us
        if part == "sampling":
            sampling_in[outer or "other"] += us
        if not e.name.startswith(RANGE):
            ops[e.name]["us"] += us
            ops[e.name]["parts"][part] += us
    if cuda:  # kernels no operator launched (or that the profiler did not link): by name
        ran, cpu_names = Counter(), {e.name for e in cpu}  # a device event named as a CPU one: an annotation
        for e in (e for e in events if e.device_type == DeviceType.CUDA and e.name not in cpu_names):
            if not getattr(e, "is_user_annotation", False):
                ran[e.name] += e.time_range.end - e.time_range.start
        for name, us in ((n, us - linked[n]) for n, us in ran.items() if us - linked[n] > 1):
            part = "sampling" if any(k in name for k in SAMPLING_KERNELS) else "other"
            parts[part][0] += us
            if part == "sampling":
                sampling_in["?"] += us
            ops[f"[kernel] {name}"]["us"] += us
            ops[f"[kernel] {name}"]["parts"][part] += us
    total = sum(f + b for f, b in parts.values())
    return {"parts": {p: [v / steps for v in fb] for p, fb in parts.items()}, "total_us": total / steps,
            "sampling_in": {k: v / steps for k, v in sampling_in.items()},
            "found": {k: v / steps for k, v in found.items()},
            "ops": {n: {**o, "us": o["us"] / steps, "calls": o["calls"] / steps} for n, o in ops.items()}}


def row_cfg(rid: int, data: Path, tiny: bool) -> tuple[dict, str]:
    """The row's config (the tiny DINO at 96x64 px for ``tiny``) and its switches as words."""
    from memfit.config import Config

    table = runpy.run_path(str(HERE / "detection_plan_rows.py"))  # a script, not a package: by its path
    switches = next(r[1] for r in table["ROWS"] if r[0] == rid)
    if "fsdp" in switches:
        raise SystemExit(f"row {rid} shards DINO over 8 ranks with FSDP: this script profiles one process (rows 1-6)")
    cfg = table["row_config"](data, switches)
    if tiny:
        cfg["model"] = Config.fromfile(TINY).to_dict()["model"]
        for t in cfg["train_dataloader"]["dataset"]["pipeline"]:
            if t["type"] == "Resize":
                t["scale"] = TINY_SCALE
    return cfg, "+".join(switches) or "plain"


def build(run_cfg: dict, device: str) -> tuple[torch.nn.Module, Any, torch.device]:
    """The model and optimizer wrapper, set up as measure_plan (and the runner) sets them up, on ``device``."""
    from memfit import dist
    from memfit.planner.bench import build_for_training

    pick = {"cpu": lambda: torch.device("cpu")}.get(device, dist.default_device)  # the CPU on a GPU machine too
    with mock.patch.object(dist, "default_device", pick):
        model, wrapper, strategy = build_for_training(run_cfg)
    return model, wrapper, strategy.device


def set_impl(model: torch.nn.Module, impl: str) -> None:
    """Set every MultiScaleDeformableAttention's ``impl`` (the sampling's implementation)."""
    from memfit.model.detection.dino.attention import MultiScaleDeformableAttention

    for m in (m for m in model.modules() if isinstance(m, MultiScaleDeformableAttention)):
        m.impl = impl


def profile_row(rid: int, args: argparse.Namespace, data: Path) -> Iterator[dict]:
    """Build row ``rid`` once and profile it with each of ``args.impl`` in turn; yields one result per
    implementation, then frees the row's memory."""
    from memfit.measure import optimizer_state_tensors
    from memfit.planner.bench import WARMUP_STEPS
    from memfit.planner.inputs import Inputs

    start = time.perf_counter()
    cfg, switches = row_cfg(rid, data, args.tiny)
    model, wrapper, device = build(cfg, args.device)
    batch = Inputs(cfg).batch()
    cuda = device.type == "cuda"
    wrapper.initialize_count_status(model, 0, 10**6)
    print(f"row {rid}: built in {time.perf_counter() - start:.1f} s", flush=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step() -> None:
        model.train_step(batch, optim_wrapper=wrapper)

    for n, impl in enumerate(args.impl.split(",")):
        set_impl(model, impl)
        start = time.perf_counter()
        for i in range(WARMUP_STEPS if n == 0 else 1):  # 2 at least; until the optimizer state exists
            step()
            if i >= 1 and optimizer_state_tensors(wrapper.optimizer):
                break
        sync()
        print(f"row {rid}, impl {impl}: {i + 1} warm-up steps in {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        step()
        sync()
        wall, before = time.perf_counter() - start, int(getattr(wrapper, "skipped_steps", 0))  # fp16's skipped steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof, part_markers(model, wrapper, sync) as host:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            profiled = (time.perf_counter() - start) / args.steps
        start = time.perf_counter()
        got = attribute(prof.events(), cuda, args.steps)
        parse = time.perf_counter() - start
        if args.trace and args.out:
            prof.export_chrome_trace(str(Path(args.out) / f"row{rid}_{impl}.json"))
        del prof
        yield {"id": rid, "switches": switches, "impl": impl, "device": str(device), "wall_s": wall,
               "profiled_s": profiled, "parse_s": parse, "cuda": cuda,
               "skipped": int(getattr(wrapper, "skipped_steps", 0)) - before,
               "matching_ms": 1e3 * host["matching_s"] / args.steps, "wait_ms": 1e3 * host["wait_s"] / args.steps,
               "matching_calls": host["calls"] // args.steps, **got}


def report(r: dict, top: int) -> list[dict]:
    """Print one row's tables; return its CSV lines."""
    total, what = r["total_us"], "self CUDA" if r["cuda"] else "self CPU"
    print(f"\n## row {r['id']} ({r['switches']}, impl {r['impl']}, {r['device']}): step {r['wall_s']:.3f} s wall, "
          f"{r['profiled_s']:.3f} s profiled; {what} time {total / 1e6:.3f} s a step "
          f"({100 * total / 1e6 / r['profiled_s']:.0f}% of the profiled wall); trace parsed in {r['parse_s']:.1f} s")
    print("sampling operators: " + (", ".join(f"{n} x{c:g}" for n, c in sorted(r["found"].items())) or "NONE FOUND"))
    if r["skipped"]:
        print(f"the fp16 GradScaler skipped {r['skipped']} profiled step(s): the optimizer line made no update")
    base = dict(id=r["id"], switches=r["switches"], impl=r["impl"])
    csv = [dict(base, kind="step", name="wall", calls=1, forward_ms="", backward_ms="", total_ms=1e3 * r["wall_s"],
                share_pct="", note=r["device"])]
    print(f"\n| top {top} operators by {what} time | calls/step | ms | share | mostly in |\n|---|---|---|---|---|")
    for name, o in sorted(r["ops"].items(), key=lambda kv: -kv[1]["us"])[:top]:
        share, main = 100 * o["us"] / total, o["parts"].most_common(1)[0][0]
        print(f"| {name} | {o['calls']:g} | {o['us'] / 1e3:.1f} | {share:.1f}% | {main} |")
        csv.append(dict(base, kind="op", name=name, calls=o["calls"], forward_ms="", backward_ms="",
                        total_ms=o["us"] / 1e3, share_pct=share, note=main))
    print("\n| part | forward ms | backward ms | total ms | share | note |\n|---|---|---|---|---|---|")
    for part in PARTS:
        fwd, bwd = r["parts"][part]
        note = ", ".join(f"{100 * v / (fwd + bwd):.0f}% in {k}" for k, v in sorted(r["sampling_in"].items())) \
            if part == "sampling" and fwd + bwd else ""
        if part == "matching":
            note = (f"host wall {r['matching_ms']:.1f} ms in {r['matching_calls']} calls (after {r['wait_ms']:.1f} ms "
                    "waiting for the queued device work)")
        share = 100 * (fwd + bwd) / total
        print(f"| {LABELS.get(part, part)} | {fwd / 1e3:.1f} | {bwd / 1e3:.1f} | {(fwd + bwd) / 1e3:.1f} "
              f"| {share:.1f}% | {note} |")
        csv.append(dict(base, kind="part", name=part, calls="", forward_ms=fwd / 1e3, backward_ms=bwd / 1e3,
                        total_ms=(fwd + bwd) / 1e3, share_pct=share, note=note))
    print(f"| total | | | {total / 1e3:.1f} | 100% | |")
    print("\n* the deformable sampling's time is not in the encoder's or decoder's lines (each operator counts in "
          "its innermost part); the optimizer's time is in the forward column", flush=True)
    return csv


def main(argv: list[str] | None = None) -> list[dict]:
    """The command line (``argv``, default sys.argv); returns each row's results, as printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6", help="row ids of detection_plan_rows.ROWS, e.g. 1,5")
    parser.add_argument("--top", type=int, default=12, help="operators in the top table")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps (times are per step)")
    parser.add_argument("--out", default=None, help="directory for detection_profile.csv (and traces)")
    parser.add_argument("--trace", action="store_true", help="with --out: a Chrome trace per row and impl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tests/fixtures/detection/dino_tiny.py at 96x64 px")
    parser.add_argument("--impl", default="auto", help="deformable sampling: auto|triton|pytorch, or a list")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        parser.error("--steps and --top must be at least 1")
    if set(args.impl.split(",")) - {"auto", "triton", "pytorch"}:
        parser.error(f"--impl {args.impl}: use auto, triton or pytorch (comma-separated for several)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu (with --tiny)")
    rows = [int(r) for r in args.rows.split(",")]
    if set(rows) - set(range(1, 9)):
        parser.error(f"--rows {args.rows}: the table's rows are 1-8 (1-6 in one process)")
    Path(args.out or ".").mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":  # CUPTI's start-up, once, outside the rows' profiles
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
            torch.cuda.synchronize()
    from memfit.data import write_shapes_coco
    from memfit.planner.report import write_csv

    results, csv = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_shapes_coco(tmp, num=8, image_size=96, split="train")  # as gpu_calibration's cases
        data = Path(tmp)
        for rid in rows:
            for r in profile_row(rid, args, data):
                csv += report(r, args.top)
                results.append(r)
                if args.out:  # after every row: a run cut short keeps what it measured
                    print(f"wrote {write_csv(csv, Path(args.out) / 'detection_profile.csv')}", flush=True)
            gc.collect()  # the row's generator has returned: its model, optimizer and batch go
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
