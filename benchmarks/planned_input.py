"""What the planner plans for, on MMDetection's DINO Swin-L config: the first batch, a given size, the derived worst.

One row of MMDetection's large-model memory table (default row 6: bf16, backbone and encoder checkpointed, 8 x
3090), predicted `--as-is` on 96 px shapes-coco images four ways: the row's fixed 1333x800 resize pipeline
(benchmarks/detection_plan_rows.py), the config's own multi-scale pipeline on its first batch (what planning
on the first batch gives), the same with `--input-shape 2x3x800x1333`, and derived (the largest batch the
pipeline can make, memfit.planner.inputs). Prints a Markdown table and writes CSV.

    python benchmarks/planned_input.py [--row 6] [--out benchmarks/results/planned_input]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from memfit.config import Config
from memfit.data import write_shapes_coco
from memfit.planner.devices import gpu
from memfit.planner.fake import first_batch
from memfit.planner.inputs import Inputs
from memfit.planner.predict import predict
from memfit.planner.report import write_csv

sys.path.insert(0, str(Path(__file__).parent))
import detection_plan_rows as rows  # noqa: E402 - the rows' switches and configs

GIB = 2**30


class FirstBatch(Inputs):
    """The loader's first batch at every micro-batch, as the planner took it before it derived the worst."""

    def batch(self, batch_size: int | None = None):  # noqa: ANN201 - a collated batch
        return first_batch({**self.loader_cfg, "batch_size": batch_size or self.batch_size})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=6, help="row id of the table (1-8)")
    parser.add_argument("--out", default="benchmarks/results/planned_input", help="CSV path without suffix")
    args = parser.parse_args()
    _, switches, _, _, device_name = next(r for r in rows.ROWS if r[0] == args.row)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        write_shapes_coco(tmp, num=8, image_size=96, split="train")
        fixed = rows.row_config(Path(tmp), switches)
        own = rows.row_config(Path(tmp), switches)
        own["train_dataloader"]["dataset"]["pipeline"] = Config.fromfile(rows.CONFIG).to_dict()["train_pipeline"]
        first = FirstBatch(own)
        first.loader_cfg = own["train_dataloader"]
        cases = [("the row's fixed 1333x800 pipeline", fixed, None),
                 ("the config's pipeline, first batch", own, first),
                 ("the config's pipeline, --input-shape 2x3x800x1333",
                  {**own, "planner": dict(input_shape="2x3x800x1333")}, None),
                 ("the config's pipeline, derived", own, None)]
        for name, cfg, inputs in cases:
            start = time.perf_counter()
            pred = predict(cfg, device=gpu(device_name), world_size=8, as_is=True, inputs=inputs)
            r = pred.results[0]
            images = (inputs or Inputs(cfg)).batch()["inputs"]
            shape = " + ".join("x".join(map(str, img.shape[-2:])) for img in images)
            out.append(dict(input=name, images=shape, allocated_gib=round(r.allocated / GIB, 4),
                            reserved_gib=round(r.reserved / GIB, 4), peak_gib=round(r.peak_bytes / GIB, 4),
                            allocated_bytes=r.allocated, seconds=round(time.perf_counter() - start, 1)))
            print(f"{name}: {out[-1]['allocated_gib']} GiB allocated ({out[-1]['seconds']} s)", flush=True)
    print(f"\nrow {args.row} ({'+'.join(switches) or 'plain'}), 8 x {device_name}")
    print("| input | images (before padding) | allocated GiB | reserved GiB | per-rank peak GiB |")
    print("|---|---|---|---|---|")
    for o in out:
        print(f"| {o['input']} | {o['images']} | {o['allocated_gib']:.2f} | {o['reserved_gib']:.2f} "
              f"| {o['peak_gib']:.2f} |")
    print(f"\nwrote {write_csv(out, Path(args.out).with_suffix('.csv'))}")


if __name__ == "__main__":
    main()
