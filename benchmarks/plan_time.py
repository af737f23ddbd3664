"""Time to plan: `memfit plan` of every plan of the issue's two workloads, on this machine's cores.

    python benchmarks/plan_time.py                    # Swin-L classification and the DINO Swin-L detector
    python benchmarks/plan_time.py --only swin        # rows whose name contains 'swin'

Each row runs ``predict`` (what ``memfit plan`` runs: every plan, the recommendation verified) and
reports the wall time, the CPU seconds of this process and its worker processes, the distinct fake
steps and the plans predicted. The target is 60 s on 2 cores for both. Workloads:

- swin-l: configs/swin_l_shapes.py (Swin-L 197M, 224 px, batch 32 per rank, AMP, FSDP) for 8 x 4090;
- dino-swin-l: MMDetection's DINO Swin-L (configs/detection/dino-5scale_swin-l_8xb2-12e_coco.py, 218M,
  two 1333x800 images per rank) for 8 x 3090, on a tiny shapes-coco set written here.

Prints a Markdown table and writes ``benchmarks/results/plan_time.csv``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers, once their pool has joined them
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _workloads(data: Path) -> dict[str, tuple[dict, str]]:
    from detection_plan_rows import row_config

    from memfit.config import Config

    return {
        "swin-l": (Config.fromfile(str(ROOT / "configs" / "swin_l_shapes.py")).to_dict(), "4090"),
        "dino-swin-l": (row_config(data, ()), "3090"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("swin-l", "dino-swin-l"), help="run this workload only")
    parser.add_argument("--out", default="benchmarks/results/plan_time.csv")
    args = parser.parse_args()

    from memfit.data import write_shapes_coco
    from memfit.planner.devices import gpu
    from memfit.planner.predict import predict
    from memfit.planner.report import write_csv
    from memfit.planner.runs import workers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_shapes_coco(tmp, num=4, image_size=96, split="train")
        for name, (cfg, device) in _workloads(Path(tmp)).items():
            if args.only and args.only != name:
                continue
            cpu, start = _cpu_seconds(), time.perf_counter()
            pred = predict(cfg, device=gpu(device), world_size=8, progress=sys.stderr.isatty())
            rows.append(dict(workload=name, target=f"8 x {device}", plans=len(pred.results),
                             fake_steps=pred.fake_steps, wall_s=round(time.perf_counter() - start, 1),
                             cpu_s=round(_cpu_seconds() - cpu, 1), workers=workers()))
            print(f"{name}: {rows[-1]['wall_s']} s", flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\n{cores} cores\n\n| workload | target | plans | fake steps | wall s | CPU s | workers |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['target']} | {r['plans']} | {r['fake_steps']} | {r['wall_s']} "
              f"| {r['cpu_s']} | {r['workers']} |")
    print(f"\nwrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
