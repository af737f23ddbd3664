"""What ``memfit bench --calibrate``'s benchmarks (:mod:`memfit.planner.calibration`) time with: the median of
repeated calls with the device synchronized around each, and the operators a call dispatches, counted as the
planner's fake step counts them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchCounter(TorchDispatchMode):
    """Counts dispatched operators, as the fake step's counter does (views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Bench:
    """Timing on one device: ``seconds(fn)`` is the median of ``repeats`` calls after ``warmup``."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device, self.quick = torch.device(device), quick
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # set_device and the properties need an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.repeats, self.warmup = (3, 1) if quick else (7, 2)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, fn: Callable[[], Any], repeats: int | None = None) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(repeats or self.repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype).requires_grad_(grad)


def rounded(x: float) -> float:
    """Four significant digits: a factor, not noise."""
    return float(f"{x:.4g}")
