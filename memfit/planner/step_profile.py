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


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``intervals`` (start, end) with overlapping ones joined, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by ``intervals`` (start, end), overlaps counted once."""
    return sum(b - a for a, b in _merged(intervals))


def _windows(device: list[tuple[int, int]], host: dict[str, list[tuple[int, int]]], count: int) -> dict[str, Any]:
    """The step cut into ``count`` equal spans of time: in each, the device's busy seconds and, for each kind of host
    event, how many began there (and the seconds of synchronisations and launches begun there). What the totals
    hide: a step whose first half keeps the device busy and whose second leaves it waiting for Python (a
    detector's backbone, then its heads and matching)."""
    spans = device + [iv for ivs in host.values() for iv in ivs]
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    width = max(1, -(-(t1 - t0) // count))

    def index(t: int) -> int:
        return min(count - 1, (t - t0) // width)

    busy = [0] * count
    for a, b in _merged(device):
        for w in range(index(a), index(max(a, b - 1)) + 1):
            lo, hi = t0 + w * width, t0 + (w + 1) * width
            busy[w] += max(0, min(b, hi) - max(a, lo))
    out: dict[str, Any] = {"window_s": width / 1e9, "device_busy_s": [ns / 1e9 for ns in busy]}
    for kind, ivs in host.items():
        n, ns = [0] * count, [0] * count
        for a, b in ivs:
            n[index(a)] += 1
            ns[index(a)] += b - a
        out[kind] = n
        if kind != "aten_ops":  # operators nest (a linear's addmm inside it): their seconds would count twice
            out[f"{kind}_s"] = [x / 1e9 for x in ns]
    return out


def _top(by_name: dict[str, tuple[int, int]], by_time: bool) -> list[tuple[str, int, float]]:
    """The :data:`TOP_KERNELS` names with the most nanoseconds (``by_time``) or calls, each (name, calls, seconds)."""
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1] if by_time else -kv[1][0])
    return [(name[:200], n, ns / 1e9) for name, (n, ns) in ranked[:TOP_KERNELS]]


def summarize(events: list[Any], wall_s: float, windows: int = 20) -> dict[str, Any]:
    """The step's figures from profiler events (objects with ``name()``, ``device_type()``, ``start_ns()`` and
    ``duration_ns()``, as ``torch.profiler``'s kineto results hold them); ``timeline``: the same figures in
    ``windows`` spans of the step (:func:`_windows`)."""
    device, kernels, families, by_name, ops_by_name = [], 0, {}, {}, {}
    host: dict[str, list[tuple[int, int]]] = {"aten_ops": [], "syncs": [], "launches": []}
    for e in events:
        name, span = e.name(), (e.start_ns(), e.start_ns() + e.duration_ns())
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            device.append(span)
            kernels += not name.startswith(("Memcpy", "Memset"))
            f = family(name)
            families[f] = families.get(f, 0) + e.duration_ns()
            n, ns = by_name.get(name, (0, 0))
            by_name[name] = (n + 1, ns + e.duration_ns())
        elif name.startswith("aten::"):
            host["aten_ops"].append(span)
            n, ns = ops_by_name.get(name, (0, 0))
            ops_by_name[name] = (n + 1, ns + e.duration_ns())
        elif name.startswith(_SYNCS):
            host["syncs"].append(span)
        elif name.startswith(_LAUNCHES):
            host["launches"].append(span)
    seconds = {k: sum(b - a for a, b in host[k]) / 1e9 for k in ("syncs", "launches")}
    return {"wall_s": wall_s, "device_busy_s": _union_ns(device) / 1e9 if device else None, "kernels": kernels,
            "aten_ops": len(host["aten_ops"]), "sync_wait_s": seconds["syncs"], "launch_s": seconds["launches"],
            # the host's time inside operators (any thread): the rest of the step is Python between them (model
            # code, hooks, a dispatch mode such as selective checkpointing's policy) or waiting
            "host_in_ops_s": _union_ns(host["aten_ops"]) / 1e9,
            "device_s_by_family": {f: ns / 1e9 for f, ns in sorted(families.items())},
            # the kernels that took longest in all, each (name, count, seconds): which ones a model misses
            "top_kernels": _top(by_name, by_time=True),
            # the operators run most often, each (name, count, seconds inside them, nested ones included)
            "top_ops": _top(ops_by_name, by_time=False),
            "timeline": _windows(device, host, windows) if device and windows else None}


TOP_KERNELS = 20  # kernel names kept in a profile, longest in all first
DEVICE_BUSY = 0.9  # a profiled step whose device was busy this share of its time or more was paced by the device


def paced_by(profile: dict[str, Any]) -> str | None:
    """What paced a profiled step (:func:`summarize`'s figures): 'device' where its kernels kept the GPU busy for
    :data:`DEVICE_BUSY` of the step or more, else 'host' (the GPU waited for Python, or for a copy or host step it
    synchronised on); None without a device."""
    busy, wall = profile.get("device_busy_s"), profile.get("wall_s")
    if busy is None or not wall:
        return None
    return "device" if busy >= DEVICE_BUSY * wall else "host"


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
