"""DINO's deformable-attention kernel on a GPU against grid_sample, by relative norms (a few seconds).

    python benchmarks/deform_check.py
    python benchmarks/deform_check.py --dry      # the small cases on the CPU, in Triton's interpreter

The largest absolute difference alone can mislead: a sampling location's gradient jumps where the location
crosses a pixel centre, and two implementations that round ``x * W - 0.5`` differently near one take different
sides. So each output and gradient is compared by ``|a - b| / |b|`` over the whole tensor (norms), and the share of
elements off by more than 1e-3 of the tensor's largest magnitude, for: the kernel in fp64 and in fp32 against the
grid_sample implementation in fp64 (small shapes, uneven levels, 3 and 32 channels) and the kernel in fp32
against grid_sample in fp32 at DINO Swin-L's encoder shapes (two 1344x800 images).
"""

from __future__ import annotations

import os
import sys

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from memfit.model.detection.dino.attention import multi_scale_deformable_attn

SMALL = [(16, 24), (8, 12), (5, 3)]
FULL = [(200, 336), (100, 168), (50, 84), (25, 42), (13, 21)]
DEVICE = "cuda"  # --dry: the small cases on the CPU in Triton's interpreter (TRITON_INTERPRET=1)


def leaves(shapes: list[tuple[int, int]], queries: int, heads: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    s = sum(h * w for h, w in shapes)
    value = torch.randn(2, s, heads, d, device=DEVICE, generator=g, dtype=torch.float64)
    locations = torch.rand(2, queries, heads, len(shapes), 4, 2, device=DEVICE, generator=g, dtype=torch.float64)
    weights = torch.rand(2, queries, heads, len(shapes), 4, device=DEVICE, generator=g, dtype=torch.float64)
    return [value, locations * 1.1 - 0.05, weights.softmax(-1)]


def run(impl: str, inputs: list[torch.Tensor], shapes: list, dtype: torch.dtype, grad: torch.Tensor) -> list:
    """Output and gradients with the value in ``dtype``; locations and weights stay fp32 (fp64 for fp64), as
    DINO passes them (a bf16 location is a pixel off at 336 wide)."""
    keep = torch.float64 if dtype == torch.float64 else torch.float32
    xs = [t.detach().to(dtype if i == 0 else keep).requires_grad_() for i, t in enumerate(inputs)]
    out = multi_scale_deformable_attn(xs[0], shapes, xs[1], xs[2], impl=impl)
    return [out.detach(), *torch.autograd.grad(out, xs, grad.to(out.dtype))]


def compare(name: str, got: list, ref: list) -> None:
    cells = []
    for a, b in zip(got, ref):
        a, b = a.double(), b.double()
        rel = ((a - b).norm() / b.norm()).item()
        off = ((a - b).abs() > 1e-3 * b.abs().max()).double().mean().item()
        cells.append(f"{rel:.1e} ({off:.1e})")
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    global DEVICE
    dry = "--dry" in sys.argv
    if dry:
        DEVICE = "cpu"
    print(f"{'CPU (interpreter)' if dry else torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| case | out | grad value | grad locations | grad weights |  (relative norm error (share off by >1e-3))")
    print("|---|---|---|---|---|")
    for d in (32, 3):
        inputs = leaves(SMALL, 300, 2, d, seed=d)
        grad = torch.randn(2, 300, 2 * d, device=DEVICE, dtype=torch.float64)
        ref = run("pytorch", inputs, SMALL, torch.float64, grad)
        compare(f"small d={d}: kernel fp64 vs grid_sample fp64", run("triton", inputs, SMALL, torch.float64, grad), ref)
        compare(f"small d={d}: kernel fp32 vs grid_sample fp64", run("triton", inputs, SMALL, torch.float32, grad), ref)
        compare(f"small d={d}: grid_sample fp32 vs fp64", run("pytorch", inputs, SMALL, torch.float32, grad), ref)
    if dry:
        return
    queries = sum(h * w for h, w in FULL)
    inputs = leaves(FULL, queries, 8, 32, seed=0)
    grad = torch.randn(2, queries, 8 * 32, device=DEVICE, dtype=torch.float64)
    ref = run("pytorch", inputs, FULL, torch.float64, grad)
    compare("DINO encoder: kernel fp32 vs grid_sample fp64", run("triton", inputs, FULL, torch.float32, grad), ref)
    compare("DINO encoder: grid_sample fp32 vs fp64", run("pytorch", inputs, FULL, torch.float32, grad), ref)
    compare("DINO encoder: kernel bf16 vs grid_sample fp64", run("triton", inputs, FULL, torch.bfloat16, grad), ref)


if __name__ == "__main__":
    main()
