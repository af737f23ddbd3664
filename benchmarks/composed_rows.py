"""Composed rows against their plans' own fake steps, at N fake ranks, on a CUDA target (no GPU needed).

The planner composes most rows of its table from a few fake steps (memfit/planner/composer.py) and runs only the
recommendation whole. This script predicts every plan of a config, picks rows at random (or those whose name
contains ``--only``), runs each row's plan as its own fake step (``memfit plan --as-is``), and prints both
figures side by side: allocated and reserved per rank. Writes a CSV.

    PYTHONPATH=. python benchmarks/composed_rows.py --model vit-b6 --world 8 --rows 30
    PYTHONPATH=. python benchmarks/composed_rows.py --model demo --world 4 --only "zero2"
    python benchmarks/composed_rows.py --model swin-l --gpu 4090 --plans @benchmarks/composed_rows_swin_l.txt
"""

from __future__ import annotations

import argparse
import csv
import random
import time
from dataclasses import replace
from pathlib import Path

from memfit.config import Config
from memfit.planner.devices import gpu
from memfit.planner.fake import build_meta_model
from memfit.planner.predict import predict
from memfit.planner.space import ModelFacts

MiB = 2**20
CONFIGS = Path(__file__).parents[1] / "configs"
# name -> (config, model in its place): the demo's ViT, ViT-B/16 at 224 px with 6 blocks (a model whose segments
# are not its size), and configs/swin_l_shapes.py as it is (197M parameters, batch 32, AMP, FSDP)
MODELS = {
    "demo": ("vit_shapes.py", None),
    "vit-b6": ("vit_shapes.py", dict(type="TimmClassifier", model_name="vit_base_patch16_224", num_classes=4,
                                     img_size=224, drop_path_rate=0.0, depth=6)),
    "swin-l": ("swin_l_shapes.py", None),
}


def config(model: str) -> dict:
    path, model_cfg = MODELS[model]
    cfg = Config.fromfile(CONFIGS / path).to_dict()
    loader = cfg["train_dataloader"]
    loader.update(num_workers=0)
    loader.pop("persistent_workers", None)
    if model_cfg is not None:
        cfg["model"] = model_cfg
        loader.update(batch_size=64)
        loader["dataset"]["image_size"] = 224
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="vit-b6")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--only", default="", help="rows whose plan name contains this")
    parser.add_argument("--plans", default="", help="these rows, in this order: plan names, comma-separated, or "
                        "@FILE, one a line (@benchmarks/composed_rows_vit_b6.txt: docs/planner_accuracy.md's 30)")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--out", default="benchmarks/results/composed_rows.csv")
    args = parser.parse_args()
    cfg = config(args.model)
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    device = gpu(args.gpu)
    start = time.perf_counter()
    pred = predict(cfg, device=device, world_size=args.world, verify=False)
    print(f"{len(pred.results)} rows predicted in {time.perf_counter() - start:.0f} s ({args.model}, "
          f"{args.world} ranks, {args.gpu})")
    rows = [r for r in pred.results if r.source == "composed" and args.only in r.plan.name]
    random.Random(0).shuffle(rows)
    if args.plans:
        named = {r.plan.name: r for r in pred.results}
        names = Path(args.plans[1:]).read_text().split("\n") if args.plans.startswith("@") else args.plans.split(",")
        names = [n.strip() for n in names if n.strip()]
        missing = [n for n in names if n not in named]
        if missing:
            raise SystemExit(f"--plans: no row named {', '.join(map(repr, missing))} among the {len(named)} predicted "
                             f"(names as `memfit plan` prints them, e.g. {next(iter(named))!r})")
        rows = [named[n] for n in names]
    out = []
    print(f"{'plan':48s} {'allocated MiB (own)':>22s} {'err':>6s} {'reserved MiB (own)':>22s} {'err':>6s}")
    for r in rows[:args.rows]:
        own = predict(replace(r.plan, configured=False).apply(cfg, facts), device=device, world_size=args.world,
                      as_is=True).results[0]
        da, dr = r.allocated / own.allocated - 1, r.reserved / own.reserved - 1
        out.append(dict(plan=r.plan.name, allocated=r.allocated, own_allocated=own.allocated, reserved=r.reserved,
                        own_reserved=own.reserved, allocated_error=round(da, 4), reserved_error=round(dr, 4)))
        print(f"{r.plan.name:48s} {r.allocated / MiB:9.1f} ({own.allocated / MiB:9.1f}) {da:+6.1%} "
              f"{r.reserved / MiB:9.1f} ({own.reserved / MiB:9.1f}) {dr:+6.1%}", flush=True)
    if out:
        a, r_ = [o["allocated_error"] for o in out], [o["reserved_error"] for o in out]
        print(f"{len(out)} rows: allocated {min(a):+.1%} .. {max(a):+.1%}, reserved {min(r_):+.1%} .. {max(r_):+.1%}")
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            w.writeheader()
            w.writerows(out)


if __name__ == "__main__":
    main()
