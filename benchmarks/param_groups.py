"""Optimizer step time: memfit's merged param groups vs MMEngine's one group per parameter.

    .venv/bin/python benchmarks/param_groups.py                      # swin_tiny, AdamW, 30 steps
    .venv/bin/python benchmarks/param_groups.py --model vit_base_patch16_224 --steps 10

Under ``paramwise_cfg`` MMEngine's DefaultOptimWrapperConstructor gives every parameter its own group;
memfit puts parameters with equal options in one group (memfit.optim.param_groups). torch's foreach
optimizers launch one fused set of kernels per group, so the number of groups sets the step's
overhead. Both optimizers hold the same options per parameter and the same gradients; their steps
are interleaved (median of ``--steps``), on one CPU thread or on the GPU when there is one. The
parameters after the run are compared as a check (the two layouts must agree).

Prints a Markdown table and writes ``benchmarks/results/param_groups.csv``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import time
from pathlib import Path

import timm
import torch

from memfit.optim.param_groups import build_param_groups

PARAMWISE = dict(norm_decay_mult=0.0, bias_decay_mult=0.0, custom_keys={"absolute_pos_embed": dict(decay_mult=0.0)})


def _per_parameter(groups: list[dict]) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": [p]}
            for g in groups for p in g["params"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    merged_model = timm.create_model(args.model).to(device)
    single_model = copy.deepcopy(merged_model)
    opts = dict(lr=1e-4, weight_decay=0.05, paramwise_cfg=PARAMWISE)
    merged = torch.optim.AdamW(build_param_groups(merged_model, **opts), foreach=True)
    single = torch.optim.AdamW(_per_parameter(build_param_groups(single_model, **opts)), foreach=True)
    for a, b in zip(merged_model.parameters(), single_model.parameters()):
        a.grad = torch.randn_like(a) * 1e-3
        b.grad = a.grad.clone()
    times: dict[str, list[float]] = {"merged": [], "per-parameter": []}
    for step in range(args.steps + 3):
        for name, opt in (("merged", merged), ("per-parameter", single))[:: 1 if step % 2 else -1]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 3:  # warm-up steps discarded
                times[name].append(time.perf_counter() - t0)
    diff = max((a - b).abs().max().item() for a, b in zip(merged_model.parameters(), single_model.parameters()))
    rows = [(name, len(opt.param_groups), statistics.median(times[name]) * 1e3)
            for name, opt in (("merged", merged), ("per-parameter", single))]
    base = rows[0][2]
    print(f"{args.model} on {device} ({torch.backends.cpu.get_cpu_capability() if device.type == 'cpu' else ''}), "
          f"AdamW foreach, {sum(p.numel() for p in merged_model.parameters()) / 1e6:.1f}M params, "
          f"max param difference {diff:.1e}\n")
    print("| groups | count | step ms | vs merged |\n|---|---|---|---|")
    for name, count, ms in rows:
        print(f"| {name} | {count} | {ms:.1f} | {ms / base:.2f}x |")
    out = Path(__file__).parent / "results" / "param_groups.csv"
    out.parent.mkdir(exist_ok=True)
    with open(out, "w", newline="") as f:
        csv.writer(f).writerows([("groups", "count", "step_ms"), *rows])


if __name__ == "__main__":
    main()
