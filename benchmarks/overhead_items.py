"""Where a Runner iteration's host time goes, item by item, against the plain loop (overhead.py --trivial).

:class:`Instrument` (a hook; it acts in ``before_run``, once the loop, model and optimizer wrapper exist)
replaces, on this Runner's objects only, each part of an iteration by a timed one: the loader iterator's
``next``, the sampler's ``advance``, every hook's ``before_train_iter``/``after_train_iter`` that does
something, and the train step's pieces (``data_preprocessor``, ``optim_context`` entered and left, the
model's ``forward``, ``parse_losses``, ``update_params`` with its ``backward``, ``step`` and ``zero_grad``).
What no timer covers (the loop's bookkeeping, ``call_hook`` walking the hooks, the timers' own calls) is
the iteration's time less the items. The plain loop's forward, backward, step and zero_grad are timed the
same way, so each row's difference is what the Runner adds.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from timing import Timers

from memfit.hooks import Hook

ITER_HOOKS = ("before_train_iter", "after_train_iter")


class Instrument(Hook):
    """Wraps the Runner's per-iteration parts in ``timers`` before the run starts (``skip``: hooks left alone)."""

    priority = "HIGHEST"

    def __init__(self, timers: Timers, skip: tuple = ()) -> None:
        self.timers, self.skip = timers, skip

    def before_run(self, runner: Any) -> None:
        t, loop = self.timers, runner.train_loop
        loader = loop.dataloader
        t.time_iterator(loader, "data: next(loader)")
        if getattr(loader.dataset, "__getitems__", None) is not None:  # memfit's SeededDataset
            t.wrap(loader.dataset, "__getitems__", "data: dataset.__getitems__")
        t.wrap(loader, "collate_fn", "data: collate_fn")
        if hasattr(loop.sampler, "advance"):
            t.wrap(loop.sampler, "advance", "sampler.advance")
        for hook in runner.hooks:
            if hook is self or hook in self.skip:
                continue
            for fn in ITER_HOOKS:
                if getattr(type(hook), fn) is not getattr(Hook, fn):  # the base class's are empty
                    t.wrap(hook, fn, f"hook {type(hook).__name__}.{fn}")
        model, ow = runner.model, runner.optim_wrapper
        t.wrap(model, "train_step", "train_step")
        t.wrap(model.data_preprocessor, "forward", "data_preprocessor")
        t.wrap(model, "forward", "forward")
        t.wrap(model, "parse_losses", "parse_losses")
        t.wrap_context(ow, "optim_context", "optim_context")
        for name in ("update_params", "backward", "step", "zero_grad"):
            t.wrap(ow, name, name)


def item_rows(runner: Timers, plain: Timers, iters: int, runner_us: float, plain_us: float) -> list[dict]:
    """Per-iteration microseconds of each item for the Runner and the plain loop, and the difference.
    ``runner_us``/``plain_us``: the mean iteration time of each (instrumented) path."""
    def r(key: str) -> float:
        return runner.per_call_us(key, iters)

    def p(key: str) -> float:
        return plain.per_call_us(key, iters)

    hooks = sorted(k for k in runner.seconds if k.startswith("hook "))
    rows = [("data: dataset.__getitems__ (memfit's SeededDataset: each sample under its own seeds)", 0.0,
             r("data: dataset.__getitems__")),
            ("data: collate_fn", 0.0, r("data: collate_fn")),
            ("data: next(loader), own (sampler, DataLoader; the plain loop has its batch in hand)", 0.0,
             r("data: next(loader)") - r("data: dataset.__getitems__") - r("data: collate_fn")),
            ("sampler.advance", 0.0, r("sampler.advance")),
            *[(k, 0.0, r(k)) for k in hooks],
            ("train_step: data_preprocessor", 0.0, r("data_preprocessor")),
            ("train_step: optim_context enter + exit (autocast, no_sync)", 0.0, r("optim_context")),
            ("forward (model and loss)", p("forward"), r("forward")),
            ("train_step: parse_losses", 0.0, r("parse_losses")),
            ("backward (optim_wrapper.backward)", p("backward"), r("backward")),
            ("optimizer step (optim_wrapper.step)", p("step"), r("step")),
            ("zero_grad (optim_wrapper.zero_grad)", p("zero_grad"), r("zero_grad")),
            ("update_params, own (loss scaling, counting, should_update)", 0.0,
             r("update_params") - r("backward") - r("step") - r("zero_grad")),
            ("train_step, own (dispatch, Module.__call__)", 0.0,
             r("train_step") - r("data_preprocessor") - r("optim_context") - r("forward") - r("parse_losses")
             - r("update_params"))]
    covered_r = sum(row[2] for row in rows)
    covered_p = sum(row[1] for row in rows)
    rows.append(("loop, own (call_hook, bookkeeping, the timers themselves)", plain_us - covered_p,
                 runner_us - covered_r))
    rows.append(("total per iteration (instrumented)", plain_us, runner_us))
    return [{"item": name, "plain_us": a, "memfit_us": b, "extra_us": b - a} for name, a, b in rows]


def print_items(rows: list[dict], headline: dict, loader_us: float) -> None:
    """The headline (uninstrumented) difference against the 5% target, then the item table, largest extra first."""
    extra, plain = headline["runner_us"] - headline["plain_us"], headline["plain_us"]
    met = extra <= 0.05 * plain
    print(f"\nRunner host time per iteration {headline['runner_us']:.1f} us, plain loop {plain:.1f} us: "
          f"{extra:+.1f} us ({100 * extra / plain:+.1f}% of the plain loop; target within 5%: "
          f"{'met' if met else 'not met'})")
    body = sorted(rows[:-2], key=lambda row: -row["extra_us"]) + rows[-2:]
    print("\n| item | plain us/iter | memfit Runner us/iter | extra us/iter |\n|---|---|---|---|")
    for row in body:
        print(f"| {row['item']} | {row['plain_us']:.1f} | {row['memfit_us']:.1f} | {row['extra_us']:+.1f} |")
    print(f"\nfor scale: a torch DataLoader over the same rows (no workers, SequentialSampler, no seeding) takes "
          f"{loader_us:.1f} us per next()")


def write_items(rows: list[dict], headline: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["item", "plain_us", "memfit_us", "extra_us"])
        w.writeheader()
        for row in rows:
            w.writerow({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        w.writerow({"item": "total per iteration (uninstrumented, median)", "plain_us": round(headline["plain_us"], 2),
                    "memfit_us": round(headline["runner_us"], 2),
                    "extra_us": round(headline["runner_us"] - headline["plain_us"], 2)})
