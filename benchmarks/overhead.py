"""Framework overhead per training step: memfit's train_step and Runner loop vs a plain PyTorch loop.

    .venv/bin/python benchmarks/overhead.py               # dim 512, depth 2, batch 64: 20 rounds x 10 steps
    .venv/bin/python benchmarks/overhead.py --rounds 5    # quicker, wider spread
    .venv/bin/python benchmarks/overhead.py --trivial     # a step that costs ~nothing: the Runner's own work, by item

Target: memfit's ``train_step`` within 2% of the plain loop.

Three copies of one model (seed 0: residual Linear-GELU-Linear blocks, AdamW lr 1e-3) train on the
same batch on one CPU thread (``torch.set_num_threads(1)``), or on the GPU where there is one
(the device the Runner picks; each timed step then ends with ``torch.cuda.synchronize``):

* plain: nanoGPT's loop, ``loss = model(x).pow(2).mean(); loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)``;
* memfit train_step: ``model.train_step((x,), optim_wrapper)`` after ``memfit.connector.setup`` with
  SingleDeviceStrategy (preprocessor, optim_context, parse_losses, update_params);
* memfit Runner: the whole ``Runner.train()`` loop, iteration-based, on an in-memory dataset of the
  batch's rows in host memory (DefaultSampler without shuffling, so every iteration sees the same
  batch; on a GPU the data preprocessor copies it over), default hooks with the logger's interval
  beyond the run and no checkpoints.

The Runner drives the run. A hook at the lowest priority (it runs after every other hook) times each
Runner iteration from inside: the time between consecutive ``after_train_iter`` calls, so data
loading, all hooks and the loop's bookkeeping are included. After each Runner iteration the hook
runs one timed plain step and one train_step step (their order alternating), so the three paths
are interleaved step by step in one process and share any drift of the machine's speed.
``--warmup`` steps of each path come first and are discarded; the rest are grouped in rounds of
``--block`` steps per path. Reported per path: the median ms per step over all rounds, and the
overhead as the median over rounds of the ratio of the round's median step time to the plain
loop's median in the same round; the spread is those ratios' interquartile range. All paths see
the same data for the same number of steps, so the models must end with the same parameters: the
largest difference is printed as a check.

Prints a Markdown table, writes ``benchmarks/results/overhead.csv`` and ``overhead.png``.

``--trivial``: one ``Linear(8, 8)`` on 8 rows (the step costs almost nothing, so what is left is the
framework's own work). The same interleaved run gives the Runner's and the plain loop's host time per
iteration (target: the Runner within 5% of the plain loop); a second, instrumented run names the difference
item by item (benchmarks/overhead_items.py): each hook, data loading, the sampler, the train step's pieces.
Prints both tables and writes ``overhead_items.csv`` (not the CSV and PNG above).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

import torch
from models import Block
from overhead_items import Instrument, item_rows, print_items, write_items
from timing import QUIET_HOOKS, Timers, synchronizer
from torch import nn

from memfit import dist
from memfit.connector import setup
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner
from memfit.strategies import SingleDeviceStrategy

RESULTS = Path(__file__).parent / "results"
PATHS = ("plain", "memfit train_step", "memfit Runner")
OPTIM = dict(optimizer=dict(type="AdamW", lr=1e-3))


class Net(BaseModel):
    """``depth`` residual blocks of width ``d``; depth 0: one ``Linear(d, d)``."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)]) if depth else nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mode: str = "tensor"):
        out = self.blocks(x)
        return dict(loss=out.pow(2).mean()) if mode == "loss" else out


class Rows(torch.utils.data.Dataset):
    """``length`` samples cycling through the batch's rows: batch i of an unshuffled loader is ``x``."""

    def __init__(self, x: torch.Tensor, length: int) -> None:
        self.x, self.n, self.length = x, len(x), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i % self.n]


class Interleave(Hook):
    """Times each Runner iteration, then runs one timed step of each other path (order alternating)."""

    priority = "LOWEST"

    def __init__(self, steps: dict, warmup: int, block: int, rounds: int, sync, timers: Timers | None = None) -> None:
        self.steps, self.warmup, self.block, self.sync, self.timers = steps, warmup, block, sync, timers
        self.times = {p: [[] for _ in range(rounds)] for p in PATHS}
        self.t0: float | None = None

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.sync()
        now = time.perf_counter()
        k = runner.iter - self.warmup  # runner.iter: the iteration just run
        if k >= 0 and self.t0 is not None:
            r = k // self.block
            self.times["memfit Runner"][r].append(now - self.t0)
            order = list(self.steps.items())
            for name, step in order if k % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                step()
                self.sync()
                self.times[name][r].append(time.perf_counter() - t)
        if self.timers is not None:  # the Runner's items count from the first timed iteration on
            self.timers.on = runner.iter + 1 >= self.warmup
        self.t0 = time.perf_counter()


def run(dim: int, depth: int, batch: int, rounds: int, block: int, warmup: int,
        items: tuple[Timers, Timers] | None = None) -> tuple[dict, float, str]:
    """Interleaved steps of the three paths (module docstring). ``items``: (Runner, plain) timers to fill
    with each part's time (the instrumented run of ``--trivial``)."""
    torch.set_num_threads(1)
    device = dist.default_device()  # the Runner's and SingleDeviceStrategy's choice
    sync = synchronizer(device)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(0)).to(device)
    plain = Net(dim, depth).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    parts = items[1] if items else None

    def plain_step() -> None:
        if parts is None:
            loss = plain(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        t0 = time.perf_counter()
        loss = plain(x).pow(2).mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for key, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2), ("zero_grad", t4 - t3)):
            parts.add(key, seconds)

    strategy = SingleDeviceStrategy()
    strategy.setup_env()
    model, wrapper = setup(Net(dim, depth), strategy, OPTIM)
    wrapper.initialize_count_status(model, 0, -1)

    def memfit_step() -> None:
        model.train_step((x,), optim_wrapper=wrapper)

    for _ in range(warmup):
        plain_step()
        memfit_step()
    iters = warmup + rounds * block
    hook = Interleave({"plain": plain_step, "memfit train_step": memfit_step}, warmup, block, rounds, sync,
                      items[0] if items else None)
    hooks: list = [hook]
    if items:
        parts.on = True  # the hook runs plain steps in timed iterations only
        hooks.append(Instrument(items[0], skip=(hook,)))
    with tempfile.TemporaryDirectory() as work_dir:
        runner = Runner(
            model=Net(dim, depth), work_dir=work_dir, optim_wrapper=OPTIM, randomness=dict(seed=0),
            train_dataloader=dict(batch_size=batch, dataset=Rows(x.cpu(), batch * iters),
                                  sampler=dict(type="DefaultSampler", shuffle=False)),
            train_cfg=dict(by_epoch=False, max_iters=iters), log_level="WARNING",
            default_hooks=QUIET_HOOKS, custom_hooks=hooks)
        runner.train()
    diff = max((p - q).abs().max().item() for other in (model, runner.model)
               for p, q in zip(plain.parameters(), other.parameters()))
    return hook.times, diff, "1 CPU thread" if device.type == "cpu" else torch.cuda.get_device_name(device)


def summarize(times: dict) -> list[dict]:
    rows = []
    plain_rounds = [statistics.median(t) for t in times["plain"]]
    for name in PATHS:
        ratios = [statistics.median(t) / b for t, b in zip(times[name], plain_rounds)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        flat = [s for t in times[name] for s in t]
        rows.append({"path": name, "median_ms": 1e3 * statistics.median(flat), "steps": len(flat),
                     "overhead_pct": 100 * (statistics.median(ratios) - 1),
                     "iqr_low_pct": 100 * (q1 - 1), "iqr_high_pct": 100 * (q3 - 1)})
    return rows


def chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    bars = ax.bar([r["path"] for r in rows], [r["median_ms"] for r in rows], color=["gray", "tab:blue", "tab:orange"])
    for bar, r in zip(bars, rows):
        label = "baseline" if r["path"] == "plain" else f"{r['overhead_pct']:+.2f}%"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("median ms / step")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loader_us(x: torch.Tensor, batch: int, n: int) -> float:
    """Mean microseconds of ``next`` on a torch DataLoader over ``x``'s rows (no workers), for scale."""
    it = iter(torch.utils.data.DataLoader(Rows(x.cpu(), batch * n), batch_size=batch))
    start = time.perf_counter()
    for _ in range(n):
        next(it)
    return 1e6 * (time.perf_counter() - start) / n


def trivial(args: argparse.Namespace) -> None:
    """``--trivial``: the Runner's host time per iteration against the plain loop's, then item by item."""
    times, _, _ = run(args.dim, args.depth, args.batch, args.rounds, args.block, args.warmup)
    flat = {name: [s for t in times[name] for s in t] for name in PATHS}
    headline = {"runner_us": 1e6 * statistics.median(flat["memfit Runner"]),
                "plain_us": 1e6 * statistics.median(flat["plain"])}
    timers, parts = Timers(), Timers()
    times, _, where = run(args.dim, args.depth, args.batch, args.rounds, args.block, args.warmup, (timers, parts))
    iters = args.rounds * args.block
    mean = {name: 1e6 * statistics.fmean(s for t in times[name] for s in t) for name in PATHS}
    rows = item_rows(timers, parts, iters, mean["memfit Runner"], mean["plain"])
    print(f"Linear({args.dim}, {args.dim}) x {args.depth or 1}, batch {args.batch}, AdamW, {where}, "
          f"{args.rounds} rounds x {args.block} steps; medians per iteration (uninstrumented run)")
    print("\n| path | median us/iter |\n|---|---|")
    for name in PATHS:
        print(f"| {name} | {1e6 * statistics.median(flat[name]):.1f} |")
    print_items(rows, headline, loader_us(torch.zeros(args.batch, args.dim), args.batch, iters))
    args.out.mkdir(parents=True, exist_ok=True)
    write_items(rows, headline, args.out / "overhead_items.csv")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trivial", action="store_true", help="Linear(8, 8) on 8 rows: the Runner's own work, "
                        "item by item (defaults below become dim 8, depth 0, batch 8, 20 x 100 steps, warm-up 50)")
    parser.add_argument("--dim", type=int, default=None, help="width (default 512)")
    parser.add_argument("--depth", type=int, default=None, help="residual blocks (default 2; 0: one Linear)")
    parser.add_argument("--batch", type=int, default=None, help="rows per batch (default 64)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--block", type=int, default=None, help="steps per path in a round (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="discarded steps per path (default 10)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the CSV and PNG files")
    args = parser.parse_args(argv)
    defaults = dict(dim=8, depth=0, batch=8, block=100, warmup=50) if args.trivial else \
        dict(dim=512, depth=2, batch=64, block=10, warmup=10)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.trivial:
        trivial(args)
        return
    times, diff, where = run(args.dim, args.depth, args.batch, args.rounds, args.block, args.warmup)
    rows = summarize(times)
    title = (f"MLP dim {args.dim} x {args.depth} blocks, batch {args.batch}, AdamW, {where}, "
             f"{args.rounds} rounds x {args.block} steps")
    print(f"{title}; Runner timed between after_train_iter calls (data loading and hooks included)")
    print("\n| path | median ms/step | overhead vs plain | IQR over rounds |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['median_ms']:.2f} | {r['overhead_pct']:+.2f}% "
              f"| [{r['iqr_low_pct']:+.2f}%, {r['iqr_high_pct']:+.2f}%] |")
    print(f"\nlargest parameter difference between the paths after training: {diff:.3g}")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    chart(rows, args.out / "overhead.png", title)


if __name__ == "__main__":
    main()
