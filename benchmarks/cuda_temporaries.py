"""On a GPU: the CUDA caching allocator's requests in one block's backward, each with the C++ function that made it.

    python benchmarks/cuda_temporaries.py [--model swin_base_patch4_window7_224] [--stage 2] [--block 1]
        [--batch 32] [--dtype bf16] [--out DIR]

Backward's allocations have no Python frames, so an allocator trace recorded with Python stacks cannot say which
operator made a block; CUDA kernels also allocate temporaries their CPU twins do not (sort buffers, fp32
accumulators), which the planner's fake step, run on CPU tensors, does not see. This records one timm block's
backward (a Swin stage's shifted-window block by default, under autocast, as training runs it) with C++ stacks and
prints the allocations grouped by size and by the first ATen function in their stack, to set beside the fake
step's requests for the same block. Writes DIR/cuda_temporaries.json. Needs CUDA and timm; a few seconds.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

# Frames that say nothing about which operator asked: the allocator, dispatch and autograd's machinery.
_PLUMBING = re.compile(r"c10::cuda::CUDACachingAllocator|c10::impl|c10::Dispatcher|at::_ops::|torch::autograd::"
                       r"(Engine|generated::details)|c10::BoxedKernel|c10::KernelFunction|std::|at::empty|"
                       r"at::detail::empty|at::TensorBase|at::native::empty|_PyEval|PyObject|\?\?")


def _function(name: str) -> str:
    """``name`` without its trailing argument list (C++ names may hold "(anonymous namespace)")."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def operator_of(frames: list[dict[str, Any]]) -> str:
    """The first frame of an allocation's stack that names an operator's implementation (``at::native::...``,
    an autograd node's ``apply``), else the first frame that is not plumbing, else '?'."""
    names = [str(f.get("name", "")) for f in frames]
    for name in names:
        if ("at::native::" in name or "Backward" in name) and not _PLUMBING.search(name):
            return _function(name)
    return next((_function(n) for n in names if n and not _PLUMBING.search(n)), "?")


def group(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Allocations in ``trace`` counted by (size, operator), largest first."""
    counts = Counter((e["size"], operator_of(e.get("frames") or [])) for e in trace if e.get("action") == "alloc")
    return [{"size": size, "operator": op, "count": n} for (size, op), n in
            sorted(counts.items(), key=lambda kv: (-kv[0][0], kv[0][1]))]


def main() -> None:
    import timm
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="swin_base_patch4_window7_224")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--block", type=int, default=1, help="the block in the stage (1: a shifted window)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model = timm.create_model(args.model, pretrained=False).cuda()
    stage = model.layers[args.stage]
    block = stage.blocks[args.block]
    size = model.patch_embed.grid_size[0] // 2 ** args.stage
    x = torch.randn(args.batch, size, size, block.norm1.normalized_shape[0], device="cuda", requires_grad=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    with torch.autocast("cuda", dtype=dtype, enabled=args.dtype != "fp32"):
        y = block(x)
    grad = torch.randn_like(y)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="all", max_entries=100_000)
    y.backward(grad)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = group(trace)
    print(f"{args.model} stage {args.stage} block {args.block}, batch {args.batch}, {args.dtype}: "
          f"{sum(r['count'] for r in rows)} allocations in backward, torch {torch.__version__}")
    print(f"{'bytes':>12s} {'count':>5s}  operator")
    for r in rows:
        print(f"{r['size']:12d} {r['count']:5d}  {r['operator']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = [{k: e.get(k) for k in ("action", "size", "stream")} | {"operator": operator_of(e.get("frames") or [])}
            for e in trace]
    (out / "cuda_temporaries.json").write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                                                           "gpu": torch.cuda.get_device_name(), "groups": rows,
                                                           "trace": keep}, indent=1))
    print(f"wrote {out / 'cuda_temporaries.json'}")


if __name__ == "__main__":
    main()
