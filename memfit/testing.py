"""Helpers for memfit's own tests: launch a script on N CPU processes (gloo) and collect results.

Distributed tests write a small Python script (or use one under tests/), start it with
``launch(script, nproc=2)`` (one process per rank, forked from a parent that imported torch and memfit once,
with torchrun's variables), and have each rank write its results to ``$MEMFIT_TEST_OUT/rank{RANK}.json``
(``write_result``); the test then reads them with ``read_results``. Checking what the ranks wrote, not only
the exit status, keeps the tests honest when a backend aborts at teardown after the work is done (DeepSpeed
with gloo does, rarely).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from torch import nn

from memfit.dist import free_port
from memfit.hooks.base import Hook

# launch()'s preload for scripts that train with DeepSpeed: its import (~4 s) then happens once, not per rank.
DEEPSPEED_PRELOAD = ("torch", "memfit.runner", "deepspeed")


def launch(script: str | Path, nproc: int = 2, args: list[str] | None = None, *, out_dir: str | Path,
           timeout: float = 300, env: dict[str, str] | None = None,
           preload: tuple[str, ...] = ("torch", "memfit.runner")) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` CPU processes as torchrun's static rendezvous would start them (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``; rank 0 hosts the
    store); results go to ``out_dir``.

    Not through torchrun: its agent imports torch before it starts the ranks, and each rank imports torch and
    memfit again (~3.5 + 2 x 7 CPU-s on a 2-core machine, more than most distributed tests' work). Here one
    fresh parent imports ``preload`` once and forks the ranks (before any thread or process group exists),
    each running ``script`` as ``__main__``. As torchrun does, a rank that fails stops the others (after a 2 s
    grace for the ones finishing). The exit status is the first non-zero one (a signal: its negative number);
    stdout and stderr are the ranks' in rank order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMFIT_TEST_OUT": str(out_dir), "CUDA_VISIBLE_DEVICES": "",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", **(env or {})}
    cmd = [sys.executable, "-c", _RANKS_PARENT, json.dumps(preload), str(script), str(nproc), json.dumps(args or []),
           str(out_dir)]
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                              start_new_session=True)
    try:
        parent_out, parent_err = parent.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and every rank
        parent.communicate()
        raise
    logs = [(out_dir / f".rank{r}.out", out_dir / f".rank{r}.err") for r in range(nproc)]
    out = "".join(p.read_text() for p, _ in logs if p.exists())
    err = "".join(p.read_text() for _, p in logs if p.exists()) + parent_err
    for path in (p for pair in logs for p in pair if p.exists()):
        path.unlink()
    lines = parent_out.splitlines()
    status = int(lines[-1]) if parent.returncode == 0 and lines else parent.returncode or 1
    return subprocess.CompletedProcess([str(script), *(args or [])], status, out, err)


# The forking parents' common start: import ``preload`` (argv[1], JSON) once; ``fork_script`` forks a child
# that runs ``script`` as ``__main__`` with its stdout/stderr in files and exits as a fresh process would.
_FORK_PREAMBLE = r"""
import json, os, runpy, signal, sys, time, traceback
for module in json.loads(sys.argv[1]):
    __import__(module)
# Out of the collector's sight: a child's collections (and its exit's) would otherwise walk, and so copy from the
# parent, every object the imports made (measured: 6 s of a 2-rank launch's 16 s on a 2-core machine).
import gc
gc.freeze()


def fork_script(script, args, out_path, err_path, **environ):
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(environ)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    sys.argv, code = [script, *args], 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    from memfit.dist import exit_process

    exit_process(code)  # the interpreter's exit (atexit handlers), without its finalization once a group was joined
"""

# launch()'s parent: fork the ranks, wait; a failed rank stops the rest. Prints the status.
_RANKS_PARENT = _FORK_PREAMBLE + r"""
script, nproc, args, out_dir = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
pids = [fork_script(script, args, *(os.path.join(out_dir, f".rank{rank}.{kind}") for kind in ("out", "err")),
                    RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank)) for rank in range(nproc)]
codes, status, failed_at = {}, 0, None
while len(codes) < nproc:
    for pid in pids:
        if pid in codes:
            continue
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            codes[pid] = os.waitstatus_to_exitcode(raw)
            if codes[pid] and failed_at is None:
                status, failed_at = codes[pid], time.monotonic()
    if failed_at is not None and time.monotonic() > failed_at + 2:
        for pid in pids:
            if pid not in codes:
                os.kill(pid, signal.SIGKILL)
    time.sleep(0.02)
print(status)
"""


def write_result(result: Any, name: str | None = None) -> None:
    """From inside a launched rank: write ``result`` (JSON-able) for the test to read."""
    rank = int(os.environ.get("RANK", 0))
    out = Path(os.environ["MEMFIT_TEST_OUT"]) / f"{name or 'rank'}{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def read_results(out_dir: str | Path, nproc: int, proc: subprocess.CompletedProcess | None = None,
                 name: str = "rank") -> list[Any]:
    """Every rank's result; a missing one fails with the launcher's output, for a readable test failure."""
    results = []
    for rank in range(nproc):
        path = Path(out_dir) / f"{name}{rank}.json"
        if not path.exists():
            tail = "" if proc is None else f"\nexit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n" \
                                           f"stderr:\n{proc.stderr[-4000:]}"
            raise AssertionError(f"rank {rank} wrote no result ({path}){tail}")
        results.append(json.loads(path.read_text()))
    return results


class RecordSteps:
    """A hook for rank scripts: the batches this rank trained on and the global loss (mean over ranks)
    of every micro-step."""

    priority = "NORMAL"

    def __init__(self) -> None:
        self.batches: list = []
        self.losses: list[float] = []

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        from memfit import dist

        self.batches.append([t.clone() for t in data_batch])
        self.losses.append(float(dist.all_reduce_mean(outputs["loss"].detach().float())))


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two results of the same keys, each a list of numbers."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))


def shapes_detection_batch(indices: list[int], image_size: int = 64, max_shapes: int = 3) -> dict:
    """ShapesDataset items ``indices`` as the detection train loader gives them: uint8 images, pseudo-collated,
    with MMDetection's sample fields (no resize, so ``img_shape == ori_shape`` and ``scale_factor`` is 1)."""
    from memfit.data import ShapesDataset

    ds = ShapesDataset(num_samples=max(indices) + 1, image_size=image_size, max_shapes=max_shapes, transform=[])
    items = [ds[i] for i in indices]
    shape = (image_size, image_size)
    return dict(inputs=[it["img"] for it in items],
                data_samples=[dict(img_id=i, img_shape=shape, ori_shape=shape, scale_factor=(1.0, 1.0),
                                   gt_instances=dict(bboxes=it["boxes"], labels=it["labels"]))
                              for i, it in zip(indices, items)])


def classification_data(n: int, dim: int, classes: int = 3, seed: int = 7) -> list:
    """``n`` random ``(x, y)`` samples, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)
    return [(xs[i], ys[i]) for i in range(n)]


def reference_run(model: Any, batches: list, k: int, amp: bool, lr: float) -> tuple[list[float], dict]:
    """Plain torch in one process, the yardstick for distributed runs: ``batches[step]`` holds every
    rank's micro-batch of that step; each gets its own forward (the same numerics as on its rank), the
    loss is their mean, and AdamW steps every ``k`` micro-steps."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, per_rank in enumerate(batches):
        parts = []
        for x, y in per_rank:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                parts.append(model(x, y, mode="loss")["loss"])
        loss = torch.stack(parts).mean()
        (loss / k).backward()
        losses.append(float(loss))
        if (step + 1) % k == 0:
            opt.step()
            opt.zero_grad()
    return losses, model.state_dict()


def regression_model() -> Any:
    """A seeded ``Linear(4, 1)`` BaseModel whose loss is the squared error (runner and hook tests)."""
    import torch
    from torch import nn

    from memfit.model import BaseModel

    class Regression(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 1)

        def forward(self, x: Any, y: Any, mode: str = "tensor") -> Any:
            out = self.fc(x)
            return {"loss": (out - y).pow(2)} if mode == "loss" else (out, y)

    return Regression()


def regression_data(n: int = 32) -> list:
    """``n`` samples ``(x, x.sum())`` for :func:`regression_model`, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [(x[i], x[i].sum(0, keepdim=True)) for i in range(n)]


def scripted_metric(script: list[dict]) -> Any:
    """A metric whose i-th evaluation returns ``script[i]`` (MMEngine's tests use a TriangleMetric the
    same way), to drive what a validation reports: best checkpoints, plateau schedulers."""
    from memfit.evaluator.metric import BaseMetric

    class Scripted(BaseMetric):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def process(self, data_batch: Any, data_samples: Any) -> None:
            self.results.append(0)

        def compute_metrics(self, results: list) -> dict:
            self.calls += 1
            return dict(script[self.calls - 1])

    return Scripted()




class SignalAt(Hook):
    """A hook for tests (``custom_hooks=[dict(type='memfit.testing.SignalAt', at=5)]``): after iteration
    ``at`` (1-based), send ``signal`` to this process ``times`` times, on rank ``rank`` only (None: on every
    rank): a preemption arriving in the middle of a run."""

    def __init__(self, at: int, signal: str = "SIGTERM", rank: int | None = None, times: int = 1) -> None:
        self.at, self.signal, self.rank, self.times = at, signal, rank, times

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        import signal as signals

        if runner.iter + 1 == self.at and self.rank in (None, runner.rank):
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signals, self.signal))


# run_forked()'s parent: fork the runs one after the other. Prints their statuses and outputs.
_FORK_PARENT = _FORK_PREAMBLE + r"""
script, runs, out_dir = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
results = []
for i, args in enumerate(runs):
    paths = [os.path.join(out_dir, f"run{i}.{s}") for s in ("out", "err")]
    code = os.waitstatus_to_exitcode(os.waitpid(fork_script(script, args, *paths), 0)[1])
    results.append([code, *(open(p).read() for p in paths)])
print(json.dumps(results))
"""


def run_forked(script: str | Path, runs: list[list[str]], *, out_dir: str | Path, timeout: float = 600,
               env: dict[str, str] | None = None, preload: tuple[str, ...] = ("torch", "memfit.runner"),
               cwd: str | Path | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``script`` once per argument list in ``runs``, one after the other, each in its own process:
    one parent imports ``preload`` once and forks a child per run (the child runs ``script`` as
    ``__main__`` and exits normally, or dies by a signal), so a chain of short runs pays Python's and
    torch's import once. Returns each run's exit status (``-N`` for signal N), stdout and stderr."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _FORK_PARENT, json.dumps(preload), str(script), json.dumps(runs), str(out_dir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if proc.returncode != 0:
        raise AssertionError(f"the forking parent failed with exit {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [subprocess.CompletedProcess([str(script), *args], code, out, err)
            for args, (code, out, err) in zip(runs, json.loads(proc.stdout.splitlines()[-1]))]


class TinyNet(nn.Sequential):
    """The kill-and-resume runs' backbone: two convolutions with dropout (model randomness to restore; per rank,
    so ``dropout=False`` where a run resumes at another world size)."""

    def __init__(self, dropout: bool = True) -> None:
        p1, p2 = (0.3, 0.2) if dropout else (0.0, 0.0)
        super().__init__(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(p1), nn.Conv2d(8, 8, 3, stride=2),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(p2), nn.Linear(8, 4))


def augmented_shapes(split: str, n: int, augment: bool) -> dict:
    """A ShapesDataset config of ``n`` 32 px images, randomly cropped and flipped when ``augment``."""
    aug = [dict(type="RandomResizedCrop", size=24, scale=(0.5, 1.0), antialias=True),
           dict(type="RandomHorizontalFlip")] if augment else [dict(type="Resize", size=24, antialias=True)]
    pipeline = aug + [dict(type="ToDtype", dtype="float32", scale=True), dict(type="Normalize", mean=[0.5], std=[0.5])]
    return dict(type="ShapesDataset", num_samples=n, image_size=32, num_classes=4, split=split, transform=pipeline)
