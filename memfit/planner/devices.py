"""Targets the planner predicts for: a table of GPUs (memory, bandwidths, dense TFLOPs) and the CPU
this process runs on (its throughput measured in a few milliseconds), plus what a CUDA device holds
beyond the tensors the fake step shows.

The fake step runs on CPU tensors, so the CUDA figures add what CPU tensors cannot show (module
constants below, each with its source): the cuBLAS workspaces (allocated through the caching
allocator), the CUDA context and NCCL's buffers (outside the allocator: in nvidia-smi, not in
``memory_reserved``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

import torch

from memfit.errors import ConfigError

GiB = 2**30
MiB = 2**20

# CUDA extras, measured on an H100 (torch 2.11, CUDA 13; benchmarks/gpu_calibration.py). cuBLAS: each
# thread that runs matmuls gets a 32 MiB workspace (torch's default on Hopper, ":4096:8"; less on older
# GPUs) and a 1 MiB cuBLASLt one, through the caching allocator: the forward's thread and autograd's
# backward thread, so two of each. Context: what the device holds outside the allocator while training
# (mem_get_info's used minus memory_reserved), 767-775 MiB for Swin-L, ViT and DINO (621 MiB before the
# first kernel). NCCL: its channel buffers (4 MiB NCCL_BUFFSIZE x 2 x channels x peers), about 250-400
# MiB per rank for 8 GPUs (NCCL's docs; one GPU cannot measure it). The allocator's rounding and segment
# slack are simulated (memfit.measure.caching_allocator), not a constant.
CUBLAS_BLOCKS = (32 * MiB, 1 * MiB, 32 * MiB, 1 * MiB)
CUBLAS_WORKSPACE = sum(CUBLAS_BLOCKS)
CUDA_CONTEXT = 780 * MiB
NCCL_BUFFERS = 320 * MiB


@dataclass(frozen=True)
class Device:
    """A training device. ``tflops``: dense peak per dtype (fp32 without TF32, as torch's matmul
    default; ``tf32``: TF32 tensor cores, on GPUs that have them); ``mem_bw``/``link_bw``/``host_bw`` in
    GB/s: device memory, the interconnect between ranks (NVLink or PCIe), and host<->device (offload).
    ``launch_us``: fixed cost per operator. ``family``: the architecture the speed levers' factors are
    given for (:data:`memfit.planner.cost.LEVER_FACTORS`)."""

    name: str
    memory: int
    tflops: dict[str, float]
    mem_bw: float
    link_bw: float
    host_bw: float
    # Eager PyTorch's host cost per operator (dispatch and launch; every dispatched operator counts,
    # views included, ``tensor.device`` queries not): fitted to the step times in
    # benchmarks/gpu_calibration_h100.json (H100, docs/planner.md): predicted step-time ratios 0.73-1.10x
    # the measured ones.
    launch_us: float = 20.0
    efficiency: float = 0.5  # fraction of peak FLOPs vision training reaches
    cuda: bool = True
    family: str = ""
    # (streaming multiprocessors, resident threads per SM): how far CUDA kernels split their work, and so the
    # scratch some take (memfit.planner.kernel_scratch). Data sheets and CUDA's compute-capability tables.
    sms: tuple[int, int] = (132, 2048)

    def dtype_tflops(self, precision: str) -> float | None:
        return self.tflops.get(precision)


def _gpu(name: str, gib: float, fp32: float, half: float, mem_bw: float, link_bw: float, host_bw: float,
         family: str, sms: tuple[int, int], tf32: float | None = None, bf16: bool = True) -> Device:
    tflops = {"fp32": fp32, "fp16": half}
    if bf16:
        tflops["bf16"] = half
    if tf32:
        tflops["tf32"] = tf32
    return Device(name, int(gib * GiB), tflops, mem_bw, link_bw, host_bw, family=family, sms=sms)


# Vendor data sheets: memory in GiB (the sheets' "24 GB" is binary: nvidia-smi shows a 4090's 24564 MiB),
# dense (no sparsity) fp32 / fp16-bf16 tensor TFLOPs with fp32 accumulation, memory bandwidth (GB/s, 10^9),
# interconnect (NVLink per GPU, else PCIe), host link (PCIe), and dense TF32 tensor TFLOPs
# (half the sheets' "with sparsity" figures): NVIDIA A100 data sheet (156), H100 data sheet (SXM 494.7,
# PCIe 378), H200 data sheet (494.7, the H100 SXM's tensor cores), L40S data sheet (183), Ada whitepaper
# (RTX 4090: 82.6), GA102 whitepaper (RTX 3090: 35.6), A10 data sheet (62.5), L4 data sheet (60), RTX A6000
# data sheet (77.4). Turing (T4) and Volta (V100) have no TF32.
GPUS: dict[str, Device] = {d.name: d for d in (
    _gpu("T4", 15.0, 8.1, 65, 320, 12, 12, "turing", (40, 1024), bf16=False),
    _gpu("V100-16", 16, 15.7, 125, 900, 150, 12, "volta", (80, 2048), bf16=False),
    _gpu("V100-32", 32, 15.7, 125, 900, 150, 12, "volta", (80, 2048), bf16=False),
    _gpu("3090", 24, 35.6, 71, 936, 25, 25, "ampere", (82, 1536), tf32=35.6),
    _gpu("4090", 24, 82.6, 165, 1008, 25, 25, "ada", (128, 1536), tf32=82.6),
    _gpu("A10", 24, 31.2, 125, 600, 25, 25, "ampere", (72, 1536), tf32=62.5),
    _gpu("L4", 24, 30.3, 121, 300, 25, 25, "ada", (58, 1536), tf32=60),
    _gpu("A6000", 48, 38.7, 155, 768, 25, 25, "ampere", (84, 1536), tf32=77.4),
    _gpu("L40S", 48, 91.6, 362, 864, 25, 25, "ada", (142, 1536), tf32=183),
    _gpu("A100-40", 40, 19.5, 312, 1555, 300, 25, "ampere", (108, 2048), tf32=156),
    _gpu("A100-80", 80, 19.5, 312, 2039, 300, 25, "ampere", (108, 2048), tf32=156),
    _gpu("H100", 80, 67, 989, 3350, 450, 55, "hopper", (132, 2048), tf32=495),
    _gpu("H100-PCIe", 80, 51, 756, 2000, 64, 55, "hopper", (114, 2048), tf32=378),
    _gpu("H200", 141, 67, 989, 4800, 450, 55, "hopper", (132, 2048), tf32=495),
)}


# Size units, case-insensitive: binary (KiB = 2^10 ... TiB = 2^40 bytes, as GPUs' memory is counted) and
# decimal (KB = 10^3 ... TB = 10^12, as the SI and disk makers write them); "B" alone is a byte count.
UNITS = {"b": 1, "kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str | int | float, key: str = "--budget") -> int:
    """A size with its unit, in bytes: '24GiB' (2^30 bytes each), '24GB' (10^9: 22.35 GiB), '500MiB',
    '1.5TiB', '4096B'; units are case-insensitive. A number without a unit is refused (``--budget 24`` would
    otherwise be 24 bytes), a Python int included: write ``f'{n}B'`` for a byte count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        raise ConfigError(f"{key}={text!r}: a size needs a unit; write it as a string: '{text}B' (bytes), or e.g. "
                          "'24GiB' (2^30 bytes) or '24GB' (10^9 bytes)")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    if not m:
        raise ConfigError(f"{key}={text!r}: not a size; write e.g. 24GiB (2^30 bytes), 24GB (10^9 bytes) or 500MiB")
    num, unit = m.groups()
    if unit.lower() not in UNITS:
        what = "a size needs a unit" if not unit else f"{unit!r} is not a unit"
        raise ConfigError(f"{key}={text!r}: {what}: {num}GiB (2^30 bytes) or {num}GB (10^9 bytes); also MiB, MB, "
                          "TiB, KiB and B (bytes)")
    n = int(float(num) * UNITS[unit.lower()])
    if n <= 0:
        raise ConfigError(f"{key}={text!r}: a size must be more than 0 bytes")
    return n


def gpu(name: str) -> Device:
    """A GPU of the table by name, case- and dash-insensitive ('h100', 'A100-80', 'rtx4090')."""
    def key(s: str) -> str:
        return re.sub(r"[^0-9a-z]", "", s.lower()).removeprefix("rtx").removeprefix("nvidia")

    for d in GPUS.values():
        if key(d.name) == key(name):
            return d
    from memfit.errors import did_you_mean

    raise ConfigError(f"--gpu {name!r}: not in the planner's table: {did_you_mean(name, list(GPUS))} "
                      "(or give --gpu-mem 24GiB)")


def custom_gpu(memory: int, like: str = "4090") -> Device:
    """A GPU known only by its memory: the speeds of ``like`` (a 24 GiB consumer card by default)."""
    return replace(GPUS[like], name=f"GPU {memory / GiB:.4g} GiB", memory=memory)


def current_cuda() -> Device:
    """The GPU this process sees: its name matched in the table (else an H100's speeds), its memory."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return replace(table_entry(props.name), name=props.name, memory=props.total_memory)


def table_entry(cuda_name: str) -> Device:
    """The table's GPU for the name CUDA reports ('NVIDIA A100-SXM4-80GB' -> A100-80, 'NVIDIA L40S' -> L40S),
    else the H100: of the entries whose model appears in the name, the one with most of its name's parts."""
    def parts(name: str) -> list[str]:
        return name.replace("-", " ").split()

    words = parts(cuda_name.replace("GB", " "))
    found = [d for n, d in GPUS.items() if parts(n)[0] in words]
    if not found:
        return GPUS["H100"]
    return max(found, key=lambda d: (sum(p in words for p in parts(d.name)), -len(parts(d.name))))


def this_cpu(seconds: float = 0.05) -> Device:
    """This machine's CPU as a target: fp32 and bf16-autocast GEMM throughput measured now (bf16 is
    emulated and several times slower on CPUs without AVX512-BF16/AMX), per-op cost measured too."""
    def rate(dtype: torch.dtype | None) -> float:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
        with ctx:
            torch.mm(a, b)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                torch.mm(a, b)
                n += 1
        return 2 * 256**3 * n / (time.perf_counter() - start) / 1e12

    x = torch.randn(8)
    start = time.perf_counter()
    for _ in range(2000):
        x = x + 1
    launch_us = (time.perf_counter() - start) / 2000 * 1e6
    tflops = {"fp32": rate(None), "bf16": rate(torch.bfloat16), "fp16": rate(torch.float16)}
    # Ranks on one CPU talk through gloo over loopback (~1 GB/s); "offload" to the host is a copy.
    return Device(f"cpu ({torch.backends.cpu.get_cpu_capability()})", _host_memory(), tflops, mem_bw=20,
                  link_bw=1, host_bw=20, launch_us=launch_us, efficiency=1.0, cuda=False, family="cpu")


def _host_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB
