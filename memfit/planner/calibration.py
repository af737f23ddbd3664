"""``memfit bench --calibrate``: microbenchmarks of this device that fit the step-time model's factors.

Each benchmark runs on random data (never zeros: some kernels skip them), warms up first and takes the
median of its repeats, the device synchronized around each. FLOPs are counted with
``torch.utils.flop_counter``, the formulas the fake step counts with, so an efficiency here is the one
:mod:`memfit.planner.cost` needs. What is measured, and the factor each gives
(:mod:`memfit.planner.time_profile` says how the model uses them):

- matmuls (a linear layer's forward, input-gradient and weight-gradient shapes) in fp32 with TF32 off, TF32,
  bf16 and fp16: achieved / the data sheet's peak of that dtype;
- convolutions (ResNet-like 3x3 and 1x1, forward and backward), NCHW and channels_last, cuDNN's benchmark
  off: achieved / the peak the model times them at (fp32: TF32, cuDNN's default);
- ``scaled_dot_product_attention`` forward and backward (ViT-like, head dim 64): recorded;
- elementwise operators and layer_norm on large tensors: the ``2 x bytes written / mem_bw`` term's
  seconds over the measured ones;
- many tiny operators in a loop, without and with autograd: host microseconds per dispatched operator;
- a small ViT's forward and backward at batch 2 (host-bound on a GPU): its host cost per operator over that;
- pinned host<->device copies: GB/s over the table's ``host_bw``;
- AdamW (foreach and fused) over ViT-B's parameter tensors at two sizes: passes over the state and the
  fixed cost per operator the fake step counts;
- AdamW's step on the host CPU (an offloaded optimizer's): GB/s of the state it touches;
- communication needs several GPUs: not measured, the table's ``link_bw`` stays.

About 40 s on an H100; ``quick`` (tests, and any CPU) uses tiny sizes and takes about a second.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from memfit.planner.calibration_optimizer import host_step, optimizer
from memfit.planner.calibration_timing import Bench, DispatchCounter, rounded
from memfit.planner.cost import (
    FSDP_TENSOR_US,
    HOST_STEP_BYTES_PER_S,
    SELECTIVE_OP_US,
    lever_factor,
)
from memfit.planner.devices import Device, current_cuda, table_entry, this_cpu
from memfit.planner.time_profile import DEFAULT, FORMAT

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def _tf32(matmul: bool, conv: bool = True) -> Iterator[None]:
    """TF32 for matmuls and cuDNN's convolutions as asked, cuDNN's benchmark off; restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def _flops(fn: Callable[[], Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _rate(b: Bench, cases: list[Callable[[], Any]]) -> tuple[float, list[float]]:
    """Achieved TFLOP/s over all ``cases`` together (the big ones weigh most, as in a step) and each one's."""
    flops = [_flops(fn) for fn in cases]
    secs = [b.seconds(fn) for fn in cases]
    return sum(flops) / sum(secs) / 1e12, [rounded(f / s / 1e12) for f, s in zip(flops, secs)]


def matmuls(b: Bench, dtype: str) -> tuple[float, list[float]]:
    """A linear layer's three matmuls (forward, input gradient, weight gradient) over training-like shapes."""
    sizes = [(256, 128, 256)] if b.quick else [(m, k, n) for m in (8192, 32768) for k, n in
                                               ((1024, 4096), (4096, 1024), (4096, 4096))]
    cases = []
    for m, k, n in sizes:
        x, w, g = (b.randn(*s, dtype=DTYPES[dtype]) for s in ((m, k), (k, n), (m, n)))
        cases += [lambda x=x, w=w: x @ w, lambda g=g, w=w: g @ w.t(), lambda x=x, g=g: x.t() @ g]
    with _tf32(matmul=dtype == "tf32"):
        return _rate(b, cases)


def convolutions(b: Bench, dtype: str, channels_last: bool) -> tuple[float, list[float]]:
    """ResNet-like 3x3 and 1x1 convolutions, forward and backward (input and weight gradients)."""
    sizes = [(2, 8, 8, 8, 3), (2, 16, 8, 8, 1)] if b.quick else [
        (64, 64, 64, 56, 3), (64, 128, 128, 28, 3), (64, 256, 64, 56, 1), (64, 64, 256, 56, 1),
        (64, 512, 128, 28, 1), (128, 128, 512, 28, 1)]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    cases = []
    for n, cin, cout, px, k in sizes:
        x = b.randn(n, cin, px, px, dtype=DTYPES[dtype]).to(memory_format=fmt).requires_grad_()
        w = b.randn(cout, cin, k, k, dtype=DTYPES[dtype]).to(memory_format=fmt).requires_grad_()
        g = b.randn(n, cout, px, px, dtype=DTYPES[dtype]).to(memory_format=fmt)
        cases.append(lambda x=x, w=w, g=g, k=k: torch.autograd.grad(F.conv2d(x, w, padding=k // 2), (x, w), g))
    with _tf32(matmul=False, conv=True):
        return _rate(b, cases)


def attention(b: Bench, dtype: str) -> tuple[float, list[float]]:
    """``scaled_dot_product_attention`` forward and backward, ViT-like (batch x heads, tokens, head dim 64)."""
    sizes = [(2, 2, 16, 8)] if b.quick else [(64, 12, 197, 64), (16, 16, 1024, 64), (2, 16, 4096, 64)]
    cases = []
    for shape in sizes:
        q, k, v = (b.randn(*shape, dtype=DTYPES[dtype], grad=True) for _ in range(3))
        g = b.randn(*shape, dtype=DTYPES[dtype])
        cases.append(lambda q=q, k=k, v=v, g=g: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v),
                                                                    (q, k, v), g))
    with _tf32(matmul=False):
        return _rate(b, cases)


def memory_bound(b: Bench, ref: Device) -> dict[str, float]:
    """The model's ``2 x bytes written / mem_bw`` seconds over the measured ones, per operator and dtype."""
    n = 2**16 if b.quick else 2**26
    out = {}
    for dtype in ("fp32", "bf16"):
        x, y = b.randn(n, dtype=DTYPES[dtype]), b.randn(n, dtype=DTYPES[dtype])
        rows = x.view(-1, 1024)
        for name, fn in (("add", lambda x=x, y=y: x + y), ("mul", lambda x=x: x * 1.5), ("gelu", lambda x=x: F.gelu(x)),
                         ("layer_norm", lambda r=rows: F.layer_norm(r, (1024,)))):
            modelled = 2 * x.numel() * x.element_size() / (ref.mem_bw * 1e9)
            out[f"{name}_{dtype}"] = rounded(modelled / b.seconds(fn))
    return out


def launches(b: Bench) -> dict[str, float]:
    """Host microseconds per dispatched operator: a loop of tiny operators, forward only and with autograd."""
    iters = 20 if b.quick else 200

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(iters):
            x = torch.relu(x * 1.0001 + 0.5).view(-1)
        return x

    x = b.randn(16)
    xg = b.randn(16, grad=True)
    cases = {"forward": lambda: chain(x), "autograd": lambda: chain(xg).sum().backward()}
    out = {}
    for name, fn in cases.items():
        with DispatchCounter() as counter:
            fn()
        out[name] = rounded(b.seconds(fn) / counter.ops * 1e6)
    return out


def model_host(b: Bench, launch_us: float) -> dict[str, float]:
    """A small ViT's forward and backward (timm's, under bf16 autocast on a GPU) at batch 2, where the host's time
    is the step's: host microseconds per operator as the fake step counts them, and their ratio to ``launch_us``
    (the profile's ``host_op_factor``: module code, hooks and autocast's casts beyond a bare operator's cost)."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4,
                              depth=2 if b.quick else 6).to(b.device)
    x, y = b.randn(2, 3, 32, 32), torch.tensor([0, 1], device=b.device)

    def step() -> None:
        with torch.autocast(b.device.type, dtype=torch.bfloat16, enabled=b.cuda):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    with DispatchCounter() as counter:
        step()
    op_us = b.seconds(step) / counter.ops * 1e6
    return {"ops": counter.ops, "op_us": rounded(op_us), "factor": rounded(op_us / launch_us)}


def host_copies(b: Bench) -> dict[str, float] | None:
    """Pinned host<->device copy GB/s (None on a CPU)."""
    if not b.cuda:
        return None
    n = 2**22 if b.quick else 2**26  # fp32: 16 MiB / 256 MiB
    host = torch.randn(n).pin_memory()
    dev = b.randn(n)
    bytes_ = n * 4
    return {"h2d": round(bytes_ / b.seconds(lambda: dev.copy_(host, non_blocking=True)) / 1e9, 2),
            "d2h": round(bytes_ / b.seconds(lambda: host.copy_(dev, non_blocking=True)) / 1e9, 2)}


def selective(b: Bench) -> dict[str, float]:
    """Selective checkpointing's host cost per operator its recomputation runs, beyond plain checkpointing's (which
    the model counts as recomputed operators): eight small blocks checkpointed with memfit's policy against the
    same blocks checkpointed without it, forward and backward, at a size where the host's time is the step's."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from memfit.memory.checkpointing import selective_context_fn

    width = 64
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.LayerNorm(width)).to(
        b.device) for _ in range(8)]
    x = b.randn(16, width, grad=True)
    context = selective_context_fn()

    def step(kind: str) -> Callable[[], None]:
        def run() -> None:
            y = x
            for block in blocks:
                if kind == "selective":
                    y = checkpoint(block, y, use_reentrant=False, context_fn=context)
                elif kind == "checkpointed":
                    y = checkpoint(block, y, use_reentrant=False)
                else:
                    y = block(y)
            y.sum().backward()
        return run

    ops = {}
    for kind in ("plain", "selective"):
        with DispatchCounter() as counter:
            step(kind)()
        ops[kind] = counter.ops
    checkpointed, sel = b.seconds(step("checkpointed")), b.seconds(step("selective"))
    recomputed = max(ops["selective"] - ops["plain"], 1)
    per_op = max(0.0, (sel - checkpointed) / recomputed * 1e6)
    return {"checkpointed_s": rounded(checkpointed), "selective_s": rounded(sel), "recomputed_ops": recomputed,
            "op_us": rounded(per_op)}


def calibrate(device: str = "cuda", quick: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this device and return its step-time profile as a JSON document (the format
    :func:`memfit.planner.time_profile.Profile.from_json` reads). ``device='cpu'`` (tests) is always quick."""
    log = log or (lambda msg: None)
    started = time.perf_counter()
    b = Bench(device, quick or device == "cpu")
    if b.cuda:
        torch.cuda.set_device(b.device)
        ref = current_cuda()
        name = table_entry(ref.name).name
        props = torch.cuda.get_device_properties(b.device)
        about = {"compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version()}
    else:
        ref, name, about = this_cpu(), "cpu", {}
    torch.manual_seed(0)
    measured: dict[str, Any] = {}
    factors: dict[str, Any] = {"matmul": {}, "conv": {}, "conv_channels_last": {}, "attention": {}}
    dtypes = [d for d in DTYPES if ref.dtype_tflops(d) and (b.cuda or d in ("fp32", "bf16"))]
    for dtype in dtypes:
        log(f"matmul {dtype}")
        tflops, each = matmuls(b, dtype)
        measured[f"matmul_{dtype}_tflops"] = each
        factors["matmul"][dtype] = rounded(tflops / ref.dtype_tflops(dtype))
    for dtype in (d for d in dtypes if d != "tf32"):
        peak = (ref.dtype_tflops("tf32") if b.cuda and dtype == "fp32" else None) or ref.dtype_tflops(dtype)
        for layout, key in (("nchw", "conv"), ("channels_last", "conv_channels_last")):
            log(f"conv {dtype} {layout}")
            tflops, each = convolutions(b, dtype, layout == "channels_last")
            measured[f"conv_{dtype}_{layout}_tflops"] = each
            factors[key][dtype] = rounded(tflops / peak)
        log(f"attention {dtype}")
        tflops, each = attention(b, dtype)
        measured[f"attention_{dtype}_tflops"] = each
        factors["attention"][dtype] = rounded(tflops / ref.dtype_tflops(dtype))
    log("memory-bound operators")
    measured["memory_bound"] = memory_bound(b, ref)
    factors["memory_bound"] = rounded(statistics.median(measured["memory_bound"].values()))
    log("operator launches")
    measured["launch_us"] = launches(b)
    factors["launch_us"] = measured["launch_us"]["autograd"]
    log("a small model's host cost")
    measured["model_host"] = host = model_host(b, factors["launch_us"])
    factors["host_op_factor"] = host["factor"]
    log("selective checkpointing")
    measured["selective"] = sel = selective(b)
    factors["selective_op_us"] = sel["op_us"]
    log("host copies")
    measured["host_gbps"] = copies = host_copies(b)
    if copies:  # the same bytes each way: their total over the total seconds
        factors["host_bw"] = rounded(2 / (1 / copies["h2d"] + 1 / copies["d2h"]) / ref.host_bw)
    log("optimizer")
    measured["optimizer"] = opt = optimizer(b, ref)
    for variant in ("foreach", "fused"):
        factors[f"optimizer_{variant}_passes"] = opt[f"{variant}_passes"]
    factors["optimizer_foreach_op_us"] = opt["foreach_op_us"]  # foreach launches kernels per list and chunk
    factors["optimizer_fused_tensor_us"] = opt["fused_tensor_us"]  # fused: a few launches, host work per tensor
    log("optimizer step on the host")
    factors["host_step_gbps"] = measured["host_step_gbps"] = host_step(b)
    factors["link_bw"] = None  # one GPU cannot measure its interconnect: the table's link_bw applies
    return {"format": FORMAT, "name": name, "gpu": ref.name, "family": ref.family, **about,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "quick": b.quick,
            "seconds": round(time.perf_counter() - started, 1), "peak_tflops": dict(ref.tflops),
            "table": {"mem_bw": ref.mem_bw, "host_bw": ref.host_bw, "link_bw": ref.link_bw},
            "factors": factors, "measured": measured}


def constants(device: Device) -> dict[str, Any]:
    """The factors the model uses for ``device`` without a profile, in a profile's terms (to print beside one)."""
    def lever(key: str) -> float:
        return lever_factor(device, key, DEFAULT)

    eff = {d: device.efficiency for d in device.tflops}
    tf32 = {"tf32": device.efficiency * lever("tf32_matmul_rate")} if "tf32" in device.tflops else {}
    return {"matmul": {**eff, **tf32}, "conv": eff,
            "conv_channels_last": {d: e / lever("channels_last") for d, e in eff.items()},
            "memory_bound": 1.0, "launch_us": device.launch_us, "host_bw": 1.0,
            "optimizer_foreach_passes": lever("optimizer_foreach_passes"), "optimizer_fused_passes": 1.0,
            "optimizer_foreach_op_us": device.launch_us, "selective_op_us": SELECTIVE_OP_US,
            "host_step_gbps": HOST_STEP_BYTES_PER_S / 1e9, "fsdp_tensor_us": FSDP_TENSOR_US}
