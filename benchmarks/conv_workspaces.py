"""On a GPU: the workspaces cuDNN takes from the caching allocator for each convolution of a grid of shapes, forward
and backward, as training runs them (benchmark off, memfit's default), beside the rule read off the H100 traces.

    python benchmarks/conv_workspaces.py [--dtypes bf16,fp16,fp32] [--formats nchw,nhwc] [--out DIR]

The planner's fake step does not take cuDNN's workspaces (docs/planner.md): ResNet-50's reserved peak is 4.2% under
its trace without them, ViT-L/16's with every block checkpointed 3.8% (its patch embedding's). Read off the traces,
a bf16 NCHW convolution mostly runs an engine that converts to NHWC, whose workspace holds the input (channels padded
to 8), the output and the weight (kernels larger than 1x1), but which engine cuDNN's heuristics pick varies with the
shape (ViT-L/16's patch embedding takes that workspace, ViT-S/16's and Swin-T's none). This records, per shape, the
blocks each call allocates and frees before it returns (the allocator's trace of that call alone), to fit the
engine rule from: the traced models' convolutions and a grid around them. Writes DIR/conv_workspaces.json. Needs
CUDA; about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# (name, batch, in channels, out channels, height, width, kernel, stride, padding, groups)
TRACED = [
    ("vit-l/16 patch embed b64", 64, 3, 1024, 224, 224, 16, 16, 0, 1),
    ("vit-s/16 patch embed b32", 32, 3, 384, 224, 224, 16, 16, 0, 1),
    ("swin-t patch embed b16", 16, 3, 96, 224, 224, 4, 4, 0, 1),
    ("resnet-50 stem b64 160px", 64, 3, 64, 160, 160, 7, 2, 3, 1),
    ("resnet-50 1x1 64->256 b64", 64, 64, 256, 40, 40, 1, 1, 0, 1),
    ("resnet-50 3x3 64 b64", 64, 64, 64, 40, 40, 3, 1, 1, 1),
    ("resnet-50 1x1 s2 256->512 b64", 64, 256, 512, 40, 40, 1, 2, 0, 1),
    ("resnet-50 3x3 s2 128 b64", 64, 128, 128, 40, 40, 3, 2, 1, 1),
    ("resnet-50 3x3 512 b64", 64, 512, 512, 5, 5, 3, 1, 1, 1),
    ("convnext dw7x7 128 b32", 32, 128, 128, 56, 56, 7, 1, 3, 128),
    ("dino neck 1x1 768->256 b2", 2, 768, 256, 50, 84, 1, 1, 0, 1),
    ("dino neck 3x3 s2 1536->256 b2", 2, 1536, 256, 25, 42, 3, 2, 1, 1),
]


def grid() -> list[tuple]:
    """Shapes around the traced ones: patch embeddings over batch and width, and 1x1/3x3 convolutions over batch,
    channels and map size."""
    out = []
    for batch in (8, 32, 64):
        for cout in (96, 384, 768, 1024):
            for k in (4, 16):
                out.append((f"patch k{k} ->{cout} b{batch}", batch, 3, cout, 224, 224, k, k, 0, 1))
        for c in (64, 256, 1024):
            for size in (7, 14, 28, 56):
                out.append((f"1x1 {c}->{c} {size}px b{batch}", batch, c, c, size, size, 1, 1, 0, 1))
                out.append((f"3x3 {c} {size}px b{batch}", batch, c, c, size, size, 3, 1, 1, 1))
    return out


def transients(trace: list[dict[str, Any]]) -> list[int]:
    """The sizes of the blocks ``trace`` (a device trace of ``torch.cuda.memory._snapshot()``: one call's) allocates
    and frees again, in allocation order: the call's workspaces, not its outputs."""
    live: dict[int, int] = {}  # addr -> index among the allocations
    sizes: list[int] = []
    freed: set[int] = set()
    for e in trace:
        if e.get("action") == "alloc":
            live[e["addr"]] = len(sizes)
            sizes.append(e["size"])
        elif e.get("action") in ("free_requested", "free_completed") and e["addr"] in live:
            freed.add(live.pop(e["addr"]))
    return [s for i, s in enumerate(sizes) if i in freed]


def nhwc_engine(case: tuple, itemsize: int) -> dict[str, int]:
    """The workspaces of the NHWC-converting engine as read off ResNet-50's H100 trace (bf16): forward the input with
    its channels padded to 8, the output and the weight (kernels larger than 1x1), and 16 bytes; backward the same
    and 147 bytes."""
    _, n, cin, cout, h, w, k, s, p, _ = case
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    pad = -(-cin // 8) * 8
    base = n * pad * h * w * itemsize + n * cout * oh * ow * itemsize + (cout * pad * k * k * itemsize if k > 1 else 0)
    return {"forward": base + 16, "backward": base + 147}


def measure(case: tuple, dtype: Any, channels_last: bool) -> dict[str, Any]:
    """One convolution's forward and backward, twice (the first call's own setup aside): the second's workspaces."""
    import torch
    import torch.nn.functional as F

    _, n, cin, cout, h, w, k, s, p, g = case
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, cin, h, w, device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    weight = torch.randn(cout, cin // g, k, k, device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    out: dict[str, Any] = {}
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", clear_history=True)
        y = F.conv2d(x, weight, stride=s, padding=p, groups=g)
        torch.cuda.synchronize()
        forward = torch.cuda.memory._snapshot()["device_traces"][0]
        grad = torch.ones_like(y)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", clear_history=True)
        y.backward(grad)
        torch.cuda.synchronize()
        backward = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        out = {"forward": transients(forward), "backward": transients(backward)}
        x.grad = weight.grad = None
        del y, grad
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--formats", default="nchw,nhwc")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rows = []
    print(f"{'case':36s} {'dtype':5s} {'fmt':4s} {'forward MiB':>24s} {'backward MiB':>30s} {'rule fwd/bwd':>14s}")
    for case in TRACED + grid():
        for name in args.dtypes.split(","):
            for fmt in args.formats.split(","):
                try:
                    got = measure(case, dtypes[name], fmt == "nhwc")
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    continue
                rule = nhwc_engine(case, dtypes[name].itemsize)
                rows.append({"case": case[0], "shape": case[1:], "dtype": name, "format": fmt, **got, "rule": rule})
                mib = lambda sizes: " ".join(f"{b / 2**20:.2f}" for b in sizes) or "-"  # noqa: E731
                print(f"{case[0]:36s} {name:5s} {fmt:4s} {mib(got['forward']):>24s} {mib(got['backward']):>30s} "
                      f"{rule['forward'] / 2**20:6.2f}/{rule['backward'] / 2**20:6.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "conv_workspaces.json").write_text(json.dumps(
        {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
         "rows": rows}, indent=1))
    print(f"wrote {out / 'conv_workspaces.json'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
