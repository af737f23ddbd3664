"""The training paths benchmarks/gpu_throughput.py alternates in one process, a block of iterations at a time.

* :class:`PlainPath`: the loop a user writes (DataLoader with workers and pinned memory, ``non_blocking``
  copies, autocast, ``zero_grad(set_to_none=True)``), run in the calling thread;
* :class:`RunnerPath`: ``Runner.from_cfg(cfg).train()`` in a thread of its own. A hook at the lowest
  priority (it runs after every other hook) ends each block: it synchronises the device, stops the clock,
  hands control back and waits for the next block, so data loading, hooks and the loop's own work are
  all inside the timed iterations, and the loop never learns it is being paused.

Only one path runs at a time. Process-wide switches (TF32, cudnn.benchmark) belong to the path whose setup
set them: :func:`backend_flags` is saved when a path pauses and restored when it resumes. :class:`Ledger`
attributes CUDA memory to the path that allocated it (the others' tensors are subtracted).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from timing import synchronizer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from memfit.hooks import Hook

_FP32_KEYS = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
              ("mkldnn", "matmul"))


class RandomImages(Dataset):
    """``length`` items cycling through ``count`` images drawn once (seed 0), so the loader only indexes
    and collates: ``{'img': float32 [3, S, S] (standard normal, as normalised images), 'label': int}``."""

    def __init__(self, image_size: int, num_classes: int = 1000, count: int = 256, length: int = 100_000) -> None:
        g = torch.Generator().manual_seed(0)
        self.img = torch.randn(count, 3, image_size, image_size, generator=g)
        self.label = torch.randint(num_classes, (count,), generator=g).tolist()
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = i % self.count
        return {"img": self.img[j], "label": self.label[j]}


def backend_flags() -> tuple:
    """The process-wide switches a path's setup may change: TF32 (torch's new per-backend strings and the
    legacy matmul precision and cuDNN flag, all of which its consistency checks compare) and cudnn.benchmark."""
    get = getattr(torch._C, "_get_fp32_precision_getter", None)
    strings = tuple(get(*k) for k in _FP32_KEYS) if get else None
    try:
        legacy = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the legacy and new APIs were mixed: keep the new strings only
        legacy = None
    return strings, legacy, torch.backends.cudnn.benchmark


def set_backend_flags(flags: tuple) -> None:
    """Restore what :func:`backend_flags` returned: the legacy setters first (they write the new strings
    too), then the new strings themselves."""
    strings, legacy, benchmark = flags
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy[0])
        torch.backends.cudnn.allow_tf32 = legacy[1]
    if strings is not None:
        for key, value in zip(_FP32_KEYS, strings):
            torch._C._set_fp32_precision_setter(*key, value)
    torch.backends.cudnn.benchmark = benchmark


class Ledger:
    """Peak CUDA memory per path while several paths live in one process.

    ``allocated``: the peak of ``max_memory_allocated`` during the path's blocks, less what the paused
    paths hold (each path's holding is measured when it pauses; paused paths allocate nothing), so it is
    what the path alone would show. ``reserved``: the rise of ``max_memory_reserved`` over the warm-up
    block (built and first steps), after ``empty_cache``; exact for the first path of a case, a lower bound
    for later ones (their first blocks may fit into the free space of earlier paths' segments).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.held: dict[str, int] = {}
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    def run(self, name: str, block: Callable[[], float], warmup: bool) -> float:
        if not self.cuda:
            return block()
        if warmup:
            torch.cuda.empty_cache()
        others = sum(v for k, v in self.held.items() if k != name)
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        try:
            return block()
        finally:
            self.allocated[name] = max(self.allocated.get(name, 0), torch.cuda.max_memory_allocated() - others)
            self.held[name] = torch.cuda.memory_allocated() - others
            if warmup:
                self.reserved[name] = torch.cuda.max_memory_reserved() - reserved_before

    def drop(self, name: str) -> None:
        self.held.pop(name, None)


class PathFailed(Exception):
    """A path could not run (its Runner raised, or a lever it needs is missing): the message says why."""


class PlainPath:
    """The plain PyTorch loop, built on its first block (the build counts in the warm-up)."""

    def __init__(self, name: str, build_model: Callable[[], nn.Module], build_loader: Callable[[], DataLoader],
                 batch: int, dtype: torch.dtype | None, device: torch.device, flags: tuple) -> None:
        self.name, self.images_per_iter = name, batch
        self.build_model, self.build_loader = build_model, build_loader
        self.dtype, self.device, self.flags = dtype, device, flags
        self.sync = synchronizer(device)
        self.model: nn.Module | None = None

    def _next(self) -> dict:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def step(self) -> None:
        batch = self._next()
        x = batch["img"].to(self.device, non_blocking=True)
        y = batch["label"].to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def block(self, n: int) -> float:
        set_backend_flags(self.flags)
        self.sync()
        start = time.perf_counter()
        if self.model is None:
            torch.manual_seed(0)
            self.model = self.build_model().to(self.device).train()
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            self.loader = self.build_loader()
            self.it = iter(self.loader)
        for _ in range(n):
            self.step()
        self.sync()
        self.flags = backend_flags()
        return time.perf_counter() - start

    def close(self) -> None:
        self.model = self.opt = self.loader = self.it = None  # type: ignore[assignment]


class _Handoff(Hook):
    priority = "LOWEST"

    def __init__(self, path: RunnerPath) -> None:
        self.path = path

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        p = self.path
        p.left -= 1
        if p.left > 0:
            return
        p.sync()
        p.end = time.perf_counter()
        p.flags = backend_flags()
        p.done.set()
        p.go.wait()
        p.go.clear()
        if p.stopping:  # the loop ends after this iteration's hooks
            runner.train_loop.max_iters = runner.train_loop.iter + 1
            return
        set_backend_flags(p.flags)
        p.sync()
        p.start = time.perf_counter()


class RunnerPath:
    """memfit's Runner built from ``cfg`` (a config dict as a user writes it; ``work_dir``, the timing hook
    and a run longer than any benchmark are added), trained in its own thread a block at a time."""

    def __init__(self, name: str, cfg: dict, device: torch.device, flags: tuple) -> None:
        self.name, self.cfg, self.flags = name, cfg, flags
        self.images_per_iter = int(cfg["train_dataloader"]["batch_size"])
        self.sync = synchronizer(device)
        self.go, self.done = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        self.left, self.stopping, self.finished = 0, False, False
        self.error: BaseException | None = None
        self.runner: Any = None
        self.start = self.end = 0.0
        self.work_dir = tempfile.TemporaryDirectory(prefix="memfit-bench-")

    def _main(self) -> None:
        from memfit.runner import Runner

        try:
            set_backend_flags(self.flags)
            cfg = {**self.cfg, "work_dir": self.work_dir.name, "train_cfg": dict(by_epoch=False, max_iters=10**6),
                   "custom_hooks": [*(self.cfg.get("custom_hooks") or []), _Handoff(self)]}
            self.runner = Runner.from_cfg(cfg)
            self.runner.train()
        except BaseException as exc:  # noqa: BLE001 - reported by block() in the main thread
            self.error = exc
        finally:
            self.finished = True
            self.done.set()

    def block(self, n: int) -> float:
        if self.finished:
            raise PathFailed(self._why())
        self.left = n
        self.done.clear()
        if self.thread is None:
            self.sync()
            self.start = time.perf_counter()
            self.thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self.thread.start()
        else:
            self.go.set()
        self.done.wait()
        if self.finished:
            raise PathFailed(self._why())
        return self.end - self.start

    def _why(self) -> str:
        if self.error is None:
            return "the Runner stopped before the benchmark's last block"
        return f"{type(self.error).__name__}: {str(self.error).strip().splitlines()[0] if str(self.error) else ''}"

    def close(self) -> None:
        if self.thread is not None and not self.finished:
            self.stopping = True
            self.done.clear()
            self.go.set()
            self.done.wait(timeout=120)
            self.thread.join(timeout=60)
        self.thread = None
        # A Runner is freed by the garbage collector (it holds cycles), which closes the loader's queues before
        # the loader's iterator: its persistent workers then wait out torch's 5 s timeout each. Dropped here.
        loader = getattr(self.runner, "train_dataloader", None)
        if loader is not None and getattr(loader, "_iterator", None) is not None:
            loader._iterator = None
        self.runner = None
        self.work_dir.cleanup()
