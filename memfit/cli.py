"""The ``memfit`` command: train | plan | bench | eval | export | convert | data.

Every error ends in one line on stderr, ``memfit: error: ...``, never a traceback (``--debug``
prints it as well). Exit status 2: the input was refused before training started (a ConfigError or
CheckpointError: the line names the config file, key or path and the fix). Exit status 1: a failure
while running (the line names the epoch and iteration; the traceback is in the run's log file), or
any other error. 130: interrupted (Ctrl-C). 75: preempted (SIGTERM or SIGUSR1): a checkpoint to resume
from was saved, ``memfit train CFG --resume`` continues (requeue the job).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch  # loaded with the memfit package anyway; --version names it

from memfit._version import __version__
from memfit.cli_args import check_args, check_output
from memfit.errors import (
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    ConfigError,
    MemfitError,
    Preempted,
    failure_summary,
    first_line,
)

DESCRIPTION = "memfit: train large vision models in the memory you have (run 'memfit COMMAND --help' for each)."
EPILOG = ("Exit status: 0 done; 2 the input was refused before training started (the error line names the config "
          "key, file or path and the fix); 1 a failure while running (the line says where; the traceback is in the "
          "run's log file, --debug prints it); 75 preempted by SIGTERM/SIGUSR1 after saving a checkpoint (rerun with "
          "--resume); 130 interrupted.")


def _load_cfg(args: argparse.Namespace) -> Any:
    from memfit.config import Config, parse_cfg_options

    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(parse_cfg_options(args.cfg_options))
    if args.work_dir:
        cfg["work_dir"] = args.work_dir
    elif not cfg.get("work_dir"):
        cfg["work_dir"] = str(Path("work_dirs") / Path(args.config).stem)
    if getattr(args, "launcher", None):
        cfg["launcher"] = args.launcher
    return cfg


def _train(args: argparse.Namespace) -> int:
    from memfit.runner import Runner

    if args.gpus is not None and "RANK" not in os.environ:  # --gpus N: hand over to torchrun, which calls us back
        from memfit.launch import spawn

        return spawn(args.argv, args.gpus, nnodes=args.nnodes, node_rank=args.node_rank,
                     master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint)

    cfg = _load_cfg(args)
    if args.amp:
        from memfit.precision import with_amp

        cfg["optim_wrapper"], ignored = with_amp(cfg.get("optim_wrapper"))
        if ignored:
            print(f"memfit: {ignored}", file=sys.stderr)
    if args.resume is not None:
        cfg["resume"] = True if args.resume == "auto" else args.resume
    if args.auto_scale_lr:
        cfg["auto_scale_lr"] = _auto_scale_lr(cfg.get("auto_scale_lr"))
    if args.auto_fit is not None:
        cfg["auto_fit"] = {**_auto_fit_cfg(cfg), **({"budget": args.auto_fit} if args.auto_fit != "free" else {})}
    from memfit.log_dir import removed_if_refused

    with removed_if_refused(cfg["work_dir"]):
        Runner.from_cfg(cfg).train()
    return 0


def _auto_scale_lr(cfg: Any) -> dict:
    """``--auto-scale-lr`` (MMDetection's tools/train.py): the config's ``auto_scale_lr`` with enable=True."""
    if not (isinstance(cfg, dict) and cfg.get("base_batch_size")):
        raise ConfigError("--auto-scale-lr: the config sets no auto_scale_lr.base_batch_size: add "
                          "auto_scale_lr = dict(enable=False, base_batch_size=N), N the total batch size its lr is for")
    return {**cfg, "enable": True}


def _auto_fit_cfg(cfg: Any) -> dict:
    from memfit.planner.autofit import auto_fit_options

    return auto_fit_options(cfg.get("auto_fit") or True)


def _planner_cfg(args: argparse.Namespace) -> dict:
    """The config for ``plan`` and ``bench``, with ``--input-shape`` as ``planner.input_shape``."""
    cfg = _load_cfg(args).to_dict()
    if args.input_shape:
        from memfit.planner.inputs import parse_input_shape

        parse_input_shape(args.input_shape, "--input-shape")  # named as the user wrote it
        cfg["planner"] = {**(cfg.get("planner") or {}), "input_shape": args.input_shape}
    return cfg


def _plan(args: argparse.Namespace) -> int:
    from memfit.planner.commands import chart_path, plan_command

    cfg = _planner_cfg(args)
    if not args.png:  # --png itself is checked with the other flags
        check_output("--work-dir", chart_path(args, cfg), "plan.png")
    return plan_command(args, cfg)


def _bench(args: argparse.Namespace) -> int:
    from memfit.planner.commands import bench_command, bench_path, calibrate_command, calibration_path

    if args.calibrate:
        if args.out:
            check_output("--out", calibration_path(args), "calibration.json")
        return calibrate_command(args)
    if not args.config:
        raise ConfigError("bench needs a CONFIG (or --calibrate, which measures this GPU's step-time profile)")
    cfg = _planner_cfg(args)
    check_output("--out" if args.out else "--work-dir", bench_path(args, cfg).with_suffix(".csv"), "bench")
    return bench_command(args, cfg)


def _eval(args: argparse.Namespace) -> int:
    from memfit.log_dir import removed_if_refused
    from memfit.runner import Runner

    cfg = _load_cfg(args)
    cfg["load_from"] = _eval_checkpoint(args, cfg.get("load_from"))
    with removed_if_refused(cfg["work_dir"]):
        runner = Runner.from_cfg(cfg)
        metrics = runner.test() if cfg.get("test_dataloader") is not None else runner.val()
    for k, v in metrics.items():
        print(f"{k}: {float(v):.4f}")
    return 0


def _eval_checkpoint(args: argparse.Namespace, load_from: Any) -> Any:
    """The checkpoint to evaluate: ``eval CFG CKPT`` (MMDetection's tools/test.py), ``--checkpoint CKPT``,
    or else the config's ``load_from``. A path that does not exist is refused before anything is built."""
    if args.ckpt and args.checkpoint and args.ckpt != args.checkpoint:
        raise CheckpointError(f"eval: two checkpoints, {args.ckpt!r} and --checkpoint {args.checkpoint!r}: give one")
    path = args.ckpt or args.checkpoint
    if path is None:
        if not load_from:
            raise CheckpointError("eval: no checkpoint: memfit eval CFG CHECKPOINT (a checkpoint file, sharded "
                              "checkpoint directory or work dir), or set load_from in the config")
        return load_from
    if not Path(path).exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def _export(args: argparse.Namespace) -> int:
    from memfit.checkpoint import export_safetensors, resolve_checkpoint

    checkpoint = resolve_checkpoint(args.checkpoint, log=lambda line: print(line, file=sys.stderr))
    out = export_safetensors(checkpoint, args.out)
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Print (or write) a config as a memfit Python config: how a VISSL YAML migrates for good."""
    from memfit.config import Config, config_to_python, dump_config

    cfg = Config.fromfile(args.config)
    if args.out:
        print(f"wrote {dump_config(cfg, args.out)}", file=sys.stderr)
    else:
        sys.stdout.write(f"# Translated from {args.config} by `memfit convert`.\n{config_to_python(cfg)}")
    return 0


def _data(args: argparse.Namespace) -> int:
    """``memfit data shapes-coco``: write the synthetic shapes as a COCO detection dataset."""
    import time

    from memfit.data.shapes_coco import VAL_FRACTION, write_shapes_coco

    splits = {"train": args.num, "val": max(1, args.num // VAL_FRACTION)} if args.split == "both" else {
        args.split: args.num}
    for split, num in splits.items():
        start = time.perf_counter()
        ann_file = write_shapes_coco(args.out, num=num, image_size=args.image_size, num_classes=args.num_classes,
                                     max_shapes=args.max_shapes, seed=args.seed, split=split)
        print(f"wrote {num} {split} images to {Path(args.out) / split} and {ann_file} "
              f"({time.perf_counter() - start:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"memfit {__version__} (torch {torch.__version__})",
                        help="print memfit's and torch's versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, writes: str, optional_config: str = "") -> None:
        p.add_argument("config", help="config file (.py or .yaml)" + (f"; optional {optional_config}" if
                       optional_config else ""), **({"nargs": "?"} if optional_config else {}))
        p.add_argument("--work-dir", help=f"{writes} (default: work_dirs/<config name>)")
        p.add_argument("--cfg-options", nargs="+", metavar="KEY=VALUE",
                       help="override config keys, e.g. optim_wrapper.accumulative_counts=4")
        p.add_argument("--launcher", choices=["none", "pytorch", "slurm"],
                       help="how processes were started (torchrun sets 'pytorch' automatically)")
        p.add_argument("--debug", action="store_true",
                       help="on an error, print the full traceback too (it is always in the run's log file)")

    t = sub.add_parser("train", help="train a config")
    common(t, "where the checkpoints and the run's log folder (<timestamp>/) go")
    t.add_argument("--amp", action="store_true", help="mixed precision (AmpOptimWrapper)")
    t.add_argument("--gpus", type=int, metavar="N",
                   help="start N processes on this machine under torchrun (CPU processes with gloo when no CUDA)")
    t.add_argument("--nnodes", type=int, default=1, help="machines taking part (with --gpus)")
    t.add_argument("--node-rank", type=int, default=0, help="this machine's index in [0, nnodes) (with --gpus)")
    t.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (with --gpus)")
    t.add_argument("--master-port", type=int, default=29500, help="free port on node 0 (with --gpus)")
    t.add_argument("--rdzv-endpoint", help="host:port of a c10d rendezvous instead of --node-rank/--master-addr")
    t.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                   help="resume from the last checkpoint in the work dir, or from CHECKPOINT: a checkpoint file, "
                        "a sharded checkpoint directory, or a work dir (its last checkpoint)")
    t.add_argument("--auto-scale-lr", action="store_true",
                   help="scale the lr by the total batch size / auto_scale_lr.base_batch_size (set in the config), "
                        "as MMDetection's --auto-scale-lr")
    t.add_argument("--auto-fit", nargs="?", const="free", metavar="BUDGET",
                   help="train with the fastest plan the planner predicts to fit BUDGET per rank (e.g. 24GiB; "
                        "default: the GPU's free memory); with --gpus N it plans for N ranks")
    t.set_defaults(func=_train)

    def target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", choices=["cpu", "cuda"], help="predict for this CPU or this machine's GPU "
                       "(default: the GPU if there is one, else the CPU)")
        p.add_argument("--gpu", metavar="NAME", help="predict for a GPU of the planner's table: 3090, 4090, A100-40, "
                       "A100-80, H100, L4, T4, ... (docs/planner.md)")
        p.add_argument("--gpu-mem", metavar="SIZE", help="predict for a GPU with this much memory (e.g. 24GiB)")
        p.add_argument("--input-shape", metavar="BxCxHxW", help="plan for this image batch (e.g. 2x3x800x1344, or "
                       "HxW) instead of the largest the train pipeline can make")

    p = sub.add_parser("plan", help="predict per-rank peak memory and relative step time of every plan (no GPU "
                       "needed)")
    common(p, "where plan writes its chart, plan.png, unless --png names another path")
    target(p)
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="ranks per machine (default 1)")
    p.add_argument("--nodes", type=int, default=1, metavar="M", help="machines (default 1)")
    p.add_argument("--budget", metavar="SIZE", help="memory per rank the plan must fit (default: the device's)")
    p.add_argument("--as-is", action="store_true", help="predict only the configured plan")
    p.add_argument("--compile", action="store_true", help="list compiled twins of the plans too (torch.compile; "
                   "their memory is their eager plan's)")
    p.add_argument("--json", metavar="PATH", help="write the plans as JSON")
    p.add_argument("--png", metavar="PATH", help="chart path (default: WORK_DIR/plan.png)")
    p.add_argument("--top", type=int, default=25, help="rows to print (default 25, fastest first)")
    p.add_argument("--all", action="store_true", help="print every plan")
    p.set_defaults(func=_plan)

    b = sub.add_parser("bench", help="measure plans on this device beside the planner's predictions")
    common(b, "where bench writes its table and chart, bench.csv and bench.png, unless --out names another path",
           optional_config="with --calibrate")
    target(b)
    b.add_argument("--plans", metavar="NAME,...", help="plans by name, e.g. 'fp32,bf16 ac:blocks,fp32 mb8x4' "
                   "(default: the configured plan and each technique alone)")
    b.add_argument("--steps", type=int, default=3, metavar="K", help="timed steps per plan, median (default 3)")
    b.add_argument("--json", metavar="PATH", help="write the table as JSON")
    b.add_argument("--out", metavar="PATH", help="CSV/PNG path without suffix (default: WORK_DIR/bench); with "
                   "--calibrate the profile's JSON file (default: WORK_DIR/calibration.json)")
    b.add_argument("--calibrate", action="store_true", help="measure this GPU's speeds (matmul, convolution, "
                   "attention, memory-bound, per-operator, copy, optimizer; under a minute) as a step-time profile "
                   "for the planner, printed beside the profile in use and written to --out; no CONFIG")
    b.set_defaults(func=_bench, nodes=1)

    e = sub.add_parser("eval", help="evaluate a checkpoint on the config's test (or val) data")
    common(e, "where the run's log folder (<timestamp>/) goes")
    what = "a checkpoint or weights file, a sharded checkpoint directory, or a work dir (its last checkpoint)"
    e.add_argument("ckpt", nargs="?", metavar="CHECKPOINT", help=f"{what}; as MMDetection's tools/test.py CFG CKPT")
    e.add_argument("--checkpoint", help=f"the same as CHECKPOINT: {what} (default: the config's load_from)")
    e.set_defaults(func=_eval)

    x = sub.add_parser("export", help="write a checkpoint's model weights as one .safetensors file")
    x.add_argument("checkpoint", help="memfit checkpoint: a file, a sharded directory, or a work dir (its last "
                   "checkpoint)")
    x.add_argument("--out", required=True, help="output .safetensors path")
    x.set_defaults(func=_export)

    c = sub.add_parser("convert", help="print a config (a VISSL YAML too) as the memfit Python config it runs as")
    c.add_argument("config", help="config file (.py, .yaml, or a VISSL .yaml with the root key config:)")
    c.add_argument("--out", help="write it to this .py or .yaml file instead of printing it")
    c.set_defaults(func=_convert)

    d = sub.add_parser("data", help="make datasets")
    data_sub = d.add_subparsers(dest="data_command", required=True)
    sc = data_sub.add_parser("shapes-coco", help="write the synthetic shapes (several per image) as a COCO "
                             "detection dataset: OUT/<split>/NNNNNN.png and OUT/annotations/instances_<split>.json")
    sc.add_argument("--out", required=True, help="output directory")
    sc.add_argument("--num", type=int, default=2000, help="images in the train split (val gets num // 5), or in the "
                    "one --split asked for (default 2000)")
    sc.add_argument("--image-size", type=int, default=128, help="image side in pixels (default 128)")
    sc.add_argument("--num-classes", type=int, default=4, help="shape classes, 1 to 10 (default 4)")
    sc.add_argument("--max-shapes", type=int, default=4, help="at most this many shapes per image (default 4)")
    sc.add_argument("--seed", type=int, default=0, help="the images are a function of the seed and split (default 0)")
    sc.add_argument("--split", choices=["train", "val", "both"], default="both", help="which split (default both)")
    sc.set_defaults(func=_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_args(args)
        return args.func(args)
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except Preempted as exc:  # the checkpoint is saved: one line (rank 0's), the status a job script tests
        if os.environ.get("RANK", "0") == "0":
            print(f"memfit: {exc} (exit status {PREEMPTED_EXIT_CODE})", file=sys.stderr)
        marker = os.environ.get("MEMFIT_PREEMPTED_FILE")  # memfit.launch.spawn's: torchrun exits 1 itself
        if marker:
            Path(marker).touch()
        return PREEMPTED_EXIT_CODE
    except Exception as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        code, message = _error_line(exc, getattr(args, "config", None))
        print(f"memfit: error: {message}", file=sys.stderr)
        return code


def _error_line(exc: Exception, config: str | None) -> tuple[int, str]:
    """(exit status, one line) for an error: see the module docstring for the statuses."""
    summary = failure_summary(exc)
    if summary is not None:  # failed while running: the runner logged it with the traceback
        log_file = getattr(exc, "memfit_log_file", None)
        return 1, summary + (f" (traceback in {log_file}; --debug prints it)" if log_file else "")
    if isinstance(exc, MemfitError):
        message = str(exc).strip()
        if isinstance(exc, ConfigError) and config and config not in message:
            message = f"{config}: {message}"  # built from this file: name it
        return 2, message
    if isinstance(exc, FileNotFoundError):
        return 2, f"{exc.filename or exc}: no such file"
    return 1, f"{type(exc).__name__}: {first_line(exc)} (--debug prints the traceback)"


if __name__ == "__main__":
    sys.exit(main())
