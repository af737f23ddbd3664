"""``memfit plan`` and ``memfit bench``: the command-line faces of the planner and the bench."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError
from memfit.planner.devices import Device, GiB, custom_gpu, gpu, parse_bytes, this_cpu
from memfit.planner.space import LEVER_WORDS, OFFLOADS, PRECISIONS, SHARDINGS, Plan


def _device(args: Any) -> Device:
    import torch

    if args.gpu:
        device = gpu(args.gpu)
    elif args.gpu_mem:
        device = custom_gpu(parse_bytes(args.gpu_mem, "--gpu-mem"))
    elif args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        device = this_cpu()
    else:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no GPU here; name the target with --gpu H100 (or --gpu-mem 24GiB)")
        from memfit.planner.devices import current_cuda

        device = current_cuda()
    if args.nodes > 1:  # ranks on other machines talk over the network (InfiniBand 200 Gb/s: ~25 GB/s)
        device = replace(device, link_bw=min(device.link_bw, 25.0))
    return device


NO_PLAN_FITS = 3  # ``memfit plan``'s exit status when no plan fits the budget (2: refused input, 1: failed)


def chart_path(args: Any, cfg: dict) -> Path:
    """Where ``plan`` writes its chart: ``--png`` or WORK_DIR/plan.png."""
    return Path(args.png or Path(cfg["work_dir"]) / "plan.png")


def bench_path(args: Any, cfg: dict) -> Path:
    """``bench``'s table and chart without their suffixes: ``--out`` or WORK_DIR/bench."""
    return Path(args.out or Path(cfg["work_dir"]) / "bench")


def calibration_path(args: Any) -> Path:
    """Where ``bench --calibrate`` writes the profile: ``--out`` or WORK_DIR/calibration.json."""
    return Path(args.out or Path(args.work_dir or "work_dirs") / "calibration.json")


def plan_command(args: Any, cfg: dict) -> int:
    """Print the plans, the recommendation and the notes, write the chart (two or more plans) and the JSON;
    0, or :data:`NO_PLAN_FITS` with one line on stderr naming the budget and the smallest predicted peak."""
    from memfit.planner.chart import write_png
    from memfit.planner.predict import predict
    from memfit.planner.report import footer, plan_table, verdict, write_json

    device = _device(args)
    budget = parse_bytes(args.budget) if args.budget else None
    world = args.gpus * args.nodes
    pred = predict(cfg, device=device, world_size=world, budget=budget, as_is=args.as_is,
                   progress=sys.stderr.isatty(), compile=getattr(args, "compile", False))
    print(plan_table(pred, None if args.all else args.top))
    shown = len(pred.results) if args.all else min(args.top, len(pred.results))
    if shown < len(pred.results):
        print(f"({shown} fastest of {len(pred.results)} plans; --all shows every one)")
    print(footer(pred))
    if pred.recommended is not None:
        print(verdict(pred))
    for note in pred.notes:
        print(f"note: {note}")
    print(f"planned for {pred.input.describe()}")
    print(f"planned in {pred.seconds:.1f} s ({pred.fake_steps} fake steps); peak = "
          + ("reserved + CUDA context + NCCL buffers (see docs/planner.md)" if device.cuda else "live tensor bytes"))
    png = write_png(pred, chart_path(args, cfg))
    print(f"wrote {png}" if png else "no chart: one plan has nothing to compare (leave out --as-is to chart every "
          "plan)")
    if args.json:
        print(f"wrote {write_json(pred, args.json)}")
    if pred.recommended is None:
        sys.stdout.flush()
        print(f"memfit: {verdict(pred)}", file=sys.stderr)
        return NO_PLAN_FITS
    return 0


def parse_plan(name: str, base: Plan) -> Plan:
    """A plan from its name ('bf16 ac:blocks fsdp fused mb8x4'); precision and micro-batch left out keep
    ``base``'s values, the other axes and the speed levers left out are off."""
    fields: dict[str, Any] = {"activation_checkpointing": "none", "sharding": "none", "offload": "none",
                              "efficient_conv_bn_eval": False, **dict.fromkeys(LEVER_WORDS, False)}
    levers = {word: key for key, word in LEVER_WORDS.items()}
    for token in name.split():
        if token in PRECISIONS:
            fields["precision"] = token
        elif token.startswith("ac:"):
            fields["activation_checkpointing"] = token[3:]
        elif token in SHARDINGS:
            fields["sharding"] = token
        elif token.startswith("offload:") and token[8:] in OFFLOADS:
            fields["offload"] = token[8:]
        elif token == "conv-bn":
            fields["efficient_conv_bn_eval"] = True
        elif token in levers:
            fields[levers[token]] = True
        elif token.startswith("mb") and "x" in token:
            mb, k = token[2:].split("x")
            fields["micro_batch"], fields["accumulative_counts"] = int(mb), int(k)
        elif token == "configured":
            return base
        else:
            raise ConfigError(f"--plans: {token!r} in {name!r} is not a plan word: fp32|bf16|fp16, ac:none|stages|"
                              "blocks|every2|selective|firstN, none|zero1|zero2|fsdp, offload:params|optimizer, "
                              f"conv-bn, {', '.join(LEVER_WORDS.values())}, mbBxK")
    return replace(base, configured=False, **fields)


def default_bench_plans(configured: Plan, facts: Any, device: Device, levers: Any = None) -> list[Plan]:
    """The configured plan, then each technique alone and a few combinations, at one rank, each with the speed
    levers the planner gives its plans (``levers``, :class:`memfit.planner.levers.Levers`; none by default)."""
    base = replace(configured, configured=False, sharding="none", offload="none")
    half = "bf16" if device.dtype_tflops("bf16") else "fp16"
    plans = [configured, replace(base, precision="fp32"), replace(base, precision=half)]
    if facts.block_types:
        plans += [replace(base, activation_checkpointing=a) for a in ("blocks", "every2", "selective")]
        plans.append(replace(base, precision=half, activation_checkpointing="blocks"))
    if facts.stages:
        plans.append(replace(base, activation_checkpointing="stages"))
    if facts.frozen_bn:
        plans.append(replace(base, efficient_conv_bn_eval=True))
    if device.cuda:  # on a CPU host and device memory are one
        plans.append(replace(base, offload="optimizer"))
    if configured.micro_batch > 1:
        mb = configured.micro_batch // 2
        plans.append(replace(base, micro_batch=mb, accumulative_counts=configured.accumulative_counts
                             * configured.micro_batch // mb))
    if levers is not None:
        plans = [plans[0], *(levers.on(replace(p, compile=False)) for p in plans[1:])]
    return list(dict.fromkeys(plans))


def bench_command(args: Any, cfg: dict) -> int:
    import torch

    from memfit.planner.bench import bench
    from memfit.planner.fake import build_meta_model
    from memfit.planner.inputs import Inputs
    from memfit.planner.levers import allowed_levers
    from memfit.planner.predict import predict
    from memfit.planner.report import write_csv
    from memfit.planner.space import ModelFacts, configured_plan
    from memfit.planner.step_profile import paced_by

    device = _device(args)
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    configured = configured_plan(cfg, facts, device.cuda)
    inputs = Inputs(cfg)
    plans = [parse_plan(n.strip(), configured) for n in args.plans.split(",")] if args.plans else \
        default_bench_plans(configured, facts, device, allowed_levers(cfg, facts, device, inputs.fixed_size))
    print(f"measured on {inputs.planned().describe()}")
    pred = predict(cfg, device=device, world_size=1, budget=None, progress=sys.stderr.isatty(), verify=False,
                   inputs=inputs, also=plans)
    predicted = {r.plan: r for r in pred.results}
    cuda = torch.cuda.is_available()
    measured = bench(cfg, plans, facts, steps=args.steps, progress=sys.stderr.isatty(), inputs=inputs, profile=cuda)
    base_pred = predicted.get(measured[0].plan)
    rows = []
    for m in measured:
        p = predicted.get(m.plan)
        row = {"plan": m.plan.name, "measured_peak_gib": round(m.peak_bytes / GiB, 4),
               "predicted_peak_gib": round((p.allocated if p else 0) / GiB, 4),
               "peak_error_pct": round(100 * ((p.allocated if p else 0) - m.peak_bytes) / m.peak_bytes, 2) if p else "",
               "measured_rel_time": round(m.rel_step_time, 3),
               "predicted_rel_time": round(p.seconds / base_pred.seconds, 3) if p and base_pred else "",
               "step_seconds": round(m.seconds, 4)}
        if cuda:
            row["measured_reserved_gib"] = round(m.reserved / GiB, 4)
            row["predicted_reserved_gib"] = round((p.reserved if p else 0) / GiB, 4)
            row["measured_paced_by"] = paced_by(m.profile) or ""
            row["predicted_paced_by"] = p.time.bound if p and p.time else ""
        rows.append(row)
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    out = bench_path(args, cfg)
    print(f"wrote {write_csv(rows, out.with_suffix('.csv'))}")
    print(f"wrote {_bench_png(rows, out.with_suffix('.png'))}")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"device": device.name, "input": inputs.planned().as_dict(),
                                               "plans": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _bench_png(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    names = [r["plan"] for r in rows][::-1]
    ax.barh(names, [r["measured_peak_gib"] for r in rows][::-1], color="tab:blue", label="measured")
    ax.scatter([r["predicted_peak_gib"] for r in rows][::-1], names, color="tab:red", zorder=3, label="predicted")
    for y, r in enumerate(rows[::-1]):
        ax.annotate(f"{r['measured_rel_time']:.2f}x", (r["measured_peak_gib"], y), fontsize=7, xytext=(4, -3),
                    textcoords="offset points")
    ax.set_xlabel("peak GiB (bars: measured, dots: predicted); labels: measured step time ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def calibrate_command(args: Any) -> int:
    """``memfit bench --calibrate``: measure this GPU (``--device cpu``: this CPU, for testing), print the factors
    beside the profile the planner uses for it now, write the profile's JSON to ``--out`` and say how to
    install it."""
    import json

    import torch

    from memfit.planner.calibration import calibrate, constants
    from memfit.planner.devices import current_cuda
    from memfit.planner.time_profile import PROFILE_DIR, Profile, profile_for

    if args.config:
        raise ConfigError(f"--calibrate measures this machine's device and takes no CONFIG (got {args.config})")
    if args.gpu or args.gpu_mem or args.plans:
        raise ConfigError("--calibrate measures this machine's device: leave out --gpu, --gpu-mem and --plans")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise ConfigError("--calibrate: no CUDA GPU here; run it on the GPU to profile (--device cpu measures this "
                          "CPU, for testing)")
    where = "cpu" if args.device == "cpu" else "cuda"
    log = (lambda msg: print(f"calibrating: {msg}", file=sys.stderr)) if sys.stderr.isatty() else None
    data = calibrate(where, log=log)
    measured = Profile.from_json(data)
    target = this_cpu() if where == "cpu" else current_cuda()
    current, exact = profile_for(target)
    shown = "constants" if not current.factors else f"{current.name} profile" + ("" if exact else ", nearest")
    now = {**constants(target), **{k: v for k, v in current.factors.items() if v is not None}}
    print(f"step-time factors of {data['gpu']} (torch {data['torch']}, {data['seconds']} s)")
    print(f"| factor | measured | now ({shown}) |")
    print("|---|---|---|")
    for key, value in measured.factors.items():
        for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            before = now.get(key, {}).get(name) if name else now.get(key)
            print(f"| {key}{' ' + name if name else ''} | {_num(v)} | {_num(before)} |")
    out = calibration_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    if where == "cuda":
        print(f"to time {data['name']} GPUs with it (and, as the nearest, GPUs without a profile of their own): "
              f"cp {out} {PROFILE_DIR / (data['name'].lower() + '.json')}")
    else:
        print("a CPU profile is for testing: CPU targets measure their own speeds when planned for")
    return 0


def _num(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
