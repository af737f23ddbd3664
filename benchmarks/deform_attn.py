"""DINO's multi-scale deformable attention on a GPU: the Triton kernel against the grid_sample implementation.

    python benchmarks/deform_attn.py                 # on one GPU: ~1 min (the first call compiles the kernels)
    python benchmarks/deform_attn.py --quick         # one dtype, fewer repeats

At DINO Swin-L's shapes for two 1333x800 images (padded to 1344x800): five levels at strides 4..64 (88,981
positions an image), 8 heads of 32 channels, 4 points. Cases: the encoder's (every position is a query) and the
decoder's (900 queries + 200 denoising), with the value in fp32, bf16 and fp16 (locations and weights fp32, as
DINO passes them). For each: forward + backward time (median of ``--repeat`` CUDA-event timings after warm-up),
the peak memory the op adds above its inputs (``max_memory_allocated``), and the largest difference of the
output and of each gradient from the grid_sample implementation (fp32 reference on the same rounded inputs).
Prints a Markdown table and writes ``benchmarks/results/deform_attn.csv``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

from memfit.model.detection.dino.attention import multi_scale_deformable_attn

RESULTS = Path(__file__).parent / "results"
SHAPES = [(200, 336), (100, 168), (50, 84), (25, 42), (13, 21)]  # 1344x800 at strides 4, 8, 16, 32, 64
HEADS, D, POINTS, BATCH = 8, 32, 4, 2


def inputs(queries: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = sum(h * w for h, w in SHAPES)
    value = torch.randn(BATCH, s, HEADS, D, device="cuda", generator=g).to(dtype)
    locations = torch.rand(BATCH, queries, HEADS, len(SHAPES), POINTS, 2, device="cuda", generator=g) * 1.1 - 0.05
    weights = torch.rand(BATCH, queries, HEADS, len(SHAPES), POINTS, device="cuda", generator=g).softmax(-1)
    return [t.requires_grad_() for t in (value, locations, weights)]


def step(impl: str, leaves: list[torch.Tensor], grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = multi_scale_deformable_attn(leaves[0], SHAPES, leaves[1], leaves[2], impl=impl)
    return out, list(torch.autograd.grad(out, leaves, grad))


def measure(impl: str, queries: int, dtype: torch.dtype, repeat: int) -> dict:
    leaves = inputs(queries, dtype)
    grad = torch.randn(BATCH, queries, HEADS * D, device="cuda").to(dtype)
    for _ in range(2):  # compile / warm up
        step(impl, leaves, grad)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, grads = step(impl, leaves, grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(impl, leaves, grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return dict(out=out.detach(), grads=grads, ms=statistics.median(times), extra_mib=extra / 2**20)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="bf16 only, 3 repeats")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/deform_attn.py needs a CUDA GPU (the kernel's CPU tests: "
                         "tests/model/test_deformable_kernel.py)")
    dtypes = [torch.bfloat16] if args.quick else [torch.float32, torch.bfloat16, torch.float16]
    repeat = 3 if args.quick else args.repeat
    cases = [("encoder", sum(h * w for h, w in SHAPES)), ("decoder", 1100)]
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | value dtype | grid_sample ms | kernel ms | speed-up | grid_sample MiB | kernel MiB | "
          "max |out diff| | max |grad diff| (value, locations, weights) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, queries in cases:
        for dtype in dtypes:
            ref = measure("pytorch", queries, dtype, repeat)
            got = measure("triton", queries, dtype, repeat)
            diff = (got["out"].float() - ref["out"].float()).abs().max().item()
            grad_diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got["grads"], ref["grads"])]
            row = dict(case=case, dtype=str(dtype).split(".")[1], ref_ms=ref["ms"], kernel_ms=got["ms"],
                       speedup=ref["ms"] / got["ms"], ref_mib=ref["extra_mib"], kernel_mib=got["extra_mib"],
                       out_diff=diff, grad_value=grad_diffs[0], grad_locations=grad_diffs[1],
                       grad_weights=grad_diffs[2], device=torch.cuda.get_device_name(), torch=torch.__version__)
            rows.append(row)
            print(f"| {case} | {row['dtype']} | {row['ref_ms']:.2f} | {row['kernel_ms']:.2f} | "
                  f"{row['speedup']:.1f}x | {row['ref_mib']:.0f} | {row['kernel_mib']:.0f} | {diff:.2e} | "
                  f"{', '.join(f'{d:.1e}' for d in grad_diffs)} |", flush=True)
            del ref, got
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "deform_attn.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
