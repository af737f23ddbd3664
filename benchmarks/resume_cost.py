"""Cost of resuming mid-epoch: time to the first batch after a resume at iteration 10 vs 10,000.

memfit's sampler computes the shuffled order per position, so a resume jumps straight to the next
unseen sample: the first batch costs the same at any iteration. For contrast, the same with a plain
torch DataLoader that can only resume by skipping batches (what a loader without sampler state
does), and the memory a materialised ``torch.randperm`` of the dataset takes
(``DistributedSampler``'s approach; VISSL's motivation for StatefulDistributedSampler).

The second table times a whole ``Runner``: from ``train()`` with ``resume=<checkpoint>`` to the
first resumed iteration (checkpoint load, model/optimizer/sampler/RNG restore, loader start).

    python benchmarks/resume_cost.py [--num-samples 10000000] [--batch-size 256] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from memfit.checkpoint import load_checkpoint, save_checkpoint
from memfit.data import build_dataloader
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner


class IndexDataset:
    """``num_samples`` items, item ``i`` is ``i``: measures the sampler, not decoding."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        return int(index)


def memfit_first_batch(dataset: IndexDataset, batch_size: int, iteration: int) -> tuple[float, list[int]]:
    """Seconds from build_dataloader + load_state_dict to the first batch, and that batch."""
    t0 = time.perf_counter()
    loader = build_dataloader(dict(batch_size=batch_size, dataset=dataset), seed=0)
    state = loader.sampler.state_dict() | {"consumed": iteration * batch_size}
    loader.sampler.load_state_dict(state)
    batch = next(iter(loader))
    return time.perf_counter() - t0, batch.tolist()


def peak_bytes(fn, *args) -> int:
    """Peak bytes traced by tracemalloc (Python objects and numpy buffers) while ``fn`` runs."""
    tracemalloc.start()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def skip_first_batch(dataset: IndexDataset, batch_size: int, iteration: int) -> float:
    """Seconds to the first batch for a torch DataLoader that resumes by skipping batches."""
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)
    it = iter(loader)
    for _ in range(iteration):
        next(it)
    next(it)
    return time.perf_counter() - t0


class IndexModel(BaseModel):
    """One weight; the loss reads the batch of indices, so the data really flows through the step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, idx: torch.Tensor, mode: str = "tensor"):
        return {"loss": (self.w * idx.float().mean() * 1e-9) ** 2}


class FirstIterTimer(Hook):
    """Records when the first training iteration of this run starts."""

    def __init__(self) -> None:
        self.at: float | None = None

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def _runner(work_dir: Path, dataset: IndexDataset, batch_size: int, max_iters: int, **kw) -> Runner:
    return Runner(
        model=IndexModel(), work_dir=str(work_dir),
        train_dataloader=dict(batch_size=batch_size, dataset=dataset),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-3)),
        default_hooks=dict(logger=None, checkpoint=dict(type="CheckpointHook", interval=1, by_epoch=False)),
        randomness=dict(seed=0), log_level="WARNING", **kw,
    )


def runner_resume_seconds(dataset: IndexDataset, batch_size: int, iteration: int, root: Path) -> float:
    """Seconds from ``Runner.train()`` with ``resume=`` a checkpoint at ``iteration`` to its first
    iteration. The checkpoint is a real one written after iteration 1 with its position (loop,
    sampler, accumulation count) moved to ``iteration``: the state a run of that length saves."""
    src = root / "src"
    if not (src / "iter_1.pth").exists():
        _runner(src, dataset, batch_size, 1).train()
    state = load_checkpoint(src / "iter_1.pth")
    state["loop"] = {"epoch": 0, "iter": iteration, "batch_in_epoch": iteration}
    state["sampler"]["consumed"] = iteration * batch_size
    state["optim_wrapper"]["inner_count"] = iteration
    path = root / f"iter_{iteration}.pth"
    save_checkpoint(state, path)
    timer = FirstIterTimer()
    runner = _runner(root / f"resumed_{iteration}", dataset, batch_size, iteration + 1, resume=str(path),
                     custom_hooks=[timer])
    t0 = time.perf_counter()
    runner.train()
    return timer.at - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=10_000_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--iterations", type=int, nargs="+", default=[10, 10_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-baseline", action="store_true", help="do not time the batch-skipping loader")
    args = parser.parse_args()

    if max(args.iterations) * args.batch_size >= args.num_samples:
        parser.error(f"--iterations must stay within one epoch: < {args.num_samples // args.batch_size}")
    dataset = IndexDataset(args.num_samples)
    n, bs = args.num_samples, args.batch_size
    print(f"dataset: {n:,} index-only items, batch {bs}, memfit times: median of {args.repeats}\n")
    print("| resume at iteration | memfit first batch (ms) | memfit peak (KiB) | skip-batches loader (ms) |")
    print("|---:|---:|---:|---:|")
    for iteration in args.iterations:
        runs = [memfit_first_batch(dataset, bs, iteration) for _ in range(args.repeats)]
        ms = statistics.median(r[0] for r in runs) * 1e3
        assert all(r[1] == runs[0][1] for r in runs), "resume is not deterministic"
        kib = peak_bytes(memfit_first_batch, dataset, args.batch_size, iteration) / 1024
        skip = "-" if args.skip_baseline else f"{skip_first_batch(dataset, bs, iteration) * 1e3:,.0f}"
        print(f"| {iteration:,} | {ms:.2f} | {kib:,.0f} | {skip} |")

    print("\n| Runner resumed at iteration | train() to first iteration (ms) |")
    print("|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for iteration in args.iterations:
            runs = [runner_resume_seconds(dataset, bs, iteration, Path(tmp)) for _ in range(args.repeats)]
            print(f"| {iteration:,} | {statistics.median(runs) * 1e3:.1f} |")

    perm = torch.randperm(n)  # torch buffers are not traced by tracemalloc: count the bytes
    randperm = perm.numel() * perm.element_size() / 2**20
    print(f"\nfor comparison, torch.randperm({n:,}) (DistributedSampler): {randperm:.0f} MiB per rank")


if __name__ == "__main__":
    main()
