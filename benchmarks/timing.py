"""What the timing benchmarks share (they run as scripts: ``from timing import QUIET_HOOKS``).

A Runner that only trains (no checkpoints, no log lines, no progress bar), a device synchronizer, and
:class:`Timers`, which replace methods of single objects by timed ones so that the time a Runner spends
in each of its parts (hooks, data loading, the train step's pieces) adds up item by item.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

# Default hooks for a timed Runner: no checkpoint, the logger's interval beyond any run.
QUIET_HOOKS = dict(checkpoint=None, logger=dict(interval=10**9, progress_bar=False))


def synchronizer(device: torch.device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on a CUDA device, else a no-op: call it before reading a clock."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


class Timers:
    """Seconds and calls per named item, collected only while ``on`` is True.

    :meth:`wrap` shadows a method of one object (an instance attribute, so other instances of the class
    are untouched); nested items (a train step and the forward inside it) both count, so a parent's own
    time is its total less its children's.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def add(self, key: str, seconds: float, calls: int = 1) -> None:
        if self.on:
            self.seconds[key] += seconds
            self.calls[key] += calls

    def wrap(self, obj: Any, attr: str, key: str) -> None:
        """Time every call of ``obj.attr`` as ``key``."""
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        setattr(obj, attr, timed)

    def wrap_context(self, obj: Any, attr: str, key: str) -> None:
        """Time entering and leaving the context manager that ``obj.attr(...)`` returns (not its body)."""
        fn = getattr(obj, attr)
        timers = self

        class Timed:
            def __init__(self, cm: Any) -> None:
                self.cm = cm

            def __enter__(self) -> Any:
                start = time.perf_counter()
                try:
                    return self.cm.__enter__()
                finally:
                    timers.add(key, time.perf_counter() - start)

            def __exit__(self, *exc: Any) -> Any:
                start = time.perf_counter()
                try:
                    return self.cm.__exit__(*exc)
                finally:
                    timers.add(key, time.perf_counter() - start, calls=0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            cm = fn(*args, **kwargs)
            timers.add(key, time.perf_counter() - start, calls=0)
            return Timed(cm)

        setattr(obj, attr, timed)

    def time_iterator(self, loader: Any, key: str) -> None:
        """Time each ``next`` on the iterators ``iter(loader)`` returns (a subclass swapped in on this
        object only, so ``isinstance`` checks still see a DataLoader)."""
        base = type(loader)
        timers = self

        class TimedIter:
            def __init__(self, it: Any) -> None:
                self.it = it

            def __iter__(self) -> TimedIter:
                return self

            def __next__(self) -> Any:
                start = time.perf_counter()
                try:
                    return next(self.it)
                finally:
                    timers.add(key, time.perf_counter() - start)

            def __len__(self) -> int:
                return len(self.it)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.it, name)

        class Timed(base):  # type: ignore[misc, valid-type]
            def __iter__(self) -> Any:
                return TimedIter(base.__iter__(self))

        Timed.__name__ = base.__name__
        loader.__class__ = Timed

    def per_call_us(self, key: str, per: int) -> float:
        """Microseconds of ``key`` per ``per`` units (e.g. iterations)."""
        return 1e6 * self.seconds.get(key, 0.0) / max(per, 1)


def profile_block(block: Callable[[int], Any], steps: int = 5, top: int = 12) -> dict:
    """``block(steps)`` under torch.profiler: its CUDA kernels' milliseconds and count per step, the ``top``
    kernels by device time (name, ms per step, calls per step), and the CPU operators' calls per step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        block(steps)
    events = prof.key_averages()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernels = sorted((e for e in events if e.device_type == cuda), key=lambda e: -e.self_device_time_total)
    return {"cuda_ms_per_step": sum(e.self_device_time_total for e in kernels) / (1e3 * steps),
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "top": [(e.key[:70], round(e.self_device_time_total / (1e3 * steps), 3), e.count // steps)
                    for e in kernels[:top]],
            "cpu_ops_per_step": {e.key: e.count // steps for e in events
                                 if e.device_type == cpu and e.count >= steps}}
