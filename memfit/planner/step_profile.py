"""Where one measured training step's time goes, host against device: what the step-time model needs to tell a
host-bound step (the GPU waits for Python to launch its kernels) from a device-bound one (Python waits for the GPU).

:func:`profiled_step` runs the step once under ``torch.profiler`` and reads its events: the device's busy time (the
union of its kernels', copies' and memsets' intervals), the host's time blocked in CUDA synchronisations and kernel
launches (a launch blocks once the device's queue is full), and how many kernels and aten operators ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
# substrings of kernel names by family, the first family that matches wins (NCCL's collectives; copies and memsets;
# flash and memory-efficient attention; cuDNN's convolutions by their names; cuBLAS's, cuBLASLt's, CUTLASS's matmuls)
_FAMILIES = (("communication", ("nccl",)), ("copy", ("Memcpy", "Memset")),
             ("attention", ("flash", "fmha", "attention", "attn")),
             ("convolution", ("conv", "implicit_gemm", "fprop", "wgrad", "dgrad")),
             ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")))


def family(kernel: str) -> str:
    """The family of the kernel named ``kernel`` (``other``: elementwise, reductions, normalisation, ...)."""
    low = kernel.lower()
    return next((f for f, keys in _FAMILIES if any(k.lower() in low for k in keys)), "other")


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by ``intervals`` (start, end), overlaps counted once."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(events: list[Any], wall_s: float) -> dict[str, Any]:
    """The step's figures from profiler events (objects with ``name()``, ``device_type()``, ``start_ns()`` and
    ``duration_ns()``, as ``torch.profiler``'s kineto results hold them)."""
    device, kernels, ops, sync_ns, launch_ns, families = [], 0, 0, 0, 0, {}
    for e in events:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            device.append((e.start_ns(), e.start_ns() + e.duration_ns()))
            kernels += not name.startswith(("Memcpy", "Memset"))
            f = family(name)
            families[f] = families.get(f, 0) + e.duration_ns()
        elif name.startswith("aten::"):
            ops += 1
        elif name.startswith(_SYNCS):
            sync_ns += e.duration_ns()
        elif name.startswith(_LAUNCHES):
            launch_ns += e.duration_ns()
    return {"wall_s": wall_s, "device_busy_s": _union_ns(device) / 1e9 if device else None, "kernels": kernels,
            "aten_ops": ops, "sync_wait_s": sync_ns / 1e9, "launch_s": launch_ns / 1e9,
            "device_s_by_family": {f: ns / 1e9 for f, ns in sorted(families.items())}}


def profiled_step(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Run ``step`` once under ``torch.profiler`` (the device synchronised around it) and :func:`summarize` it;
    empty where this torch's profiler does not expose its events, ``{"error": ...}`` where profiling failed (a
    measurement keeps its timed steps whatever the profiler does)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # a torch whose profiler keeps its events elsewhere
        return {}
    try:
        return summarize(list(events), wall)
    except Exception as exc:  # an event API this torch lacks: keep the step's figures, say why there is no profile
        return {"wall_s": wall, "error": f"{type(exc).__name__}: {exc}"}
