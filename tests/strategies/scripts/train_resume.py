"""Rank script: train with the Runner, save checkpoints, resume at this world size.

Usage: ``train_resume.py OUT_NAME RUN [RUN ...]`` where each RUN is
``STRATEGY:WORK_DIR[:RESUME_FROM[:CRASH_AT]]`` (STRATEGY a short name such as 'fsdp' or 'ddp_zero',
or 'fsdp_async': FSDP with ``async_save=True``; RESUME_FROM a path, 'auto' for last_checkpoint or
empty; CRASH_AT an iteration that raises before it runs, the run's exception being caught). Every
run is iteration based (9 iterations over a 24-sample dataset at a global batch of 4, so it crosses
an epoch) and saves ``iter_4`` / ``iter_8`` / ``iter_9``. Rank 0 records, per iteration, the global
loss (mean over ranks) and the dataset indices every rank trained on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit import dist
from memfit.hooks.base import Hook
from memfit.model import BaseModel
from memfit.runner import Runner
from memfit.testing import write_result

GLOBAL_BATCH, DIM, N = 4, 8, 24


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, 3)

    def forward(self, x, y, idx, mode="tensor"):
        out = self.head(self.blocks(x))
        return dict(loss=F.cross_entropy(out, y)) if mode == "loss" else (out, y)


class Record(Hook):
    def __init__(self, crash_at: int | None = None) -> None:
        self.rows: list = []
        self.crash_at = crash_at
        self.visible: dict = {}  # iteration -> (checkpoints under their final names, last_checkpoint)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        from memfit.checkpoint import find_checkpoints, read_latest

        n = runner.iter + 1
        latest = read_latest(runner.work_dir)
        self.visible[n] = ([p.name for p in find_checkpoints(runner.work_dir)], latest and latest.name)
        if n == self.crash_at:
            raise RuntimeError(f"simulated crash before iteration {n}")

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        loss = float(dist.all_reduce_mean(outputs["loss"].detach().float()))
        seen = sorted(i for part in dist.all_gather_object(data_batch[2].tolist()) for i in part)
        self.rows.append([runner.iter + 1, loss, seen])


def dataset() -> list:
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(N, DIM, generator=g), torch.randint(0, 3, (N,), generator=g)
    return [(xs[i], ys[i], torch.tensor(i)) for i in range(N)]


def train(strategy: str, work_dir: str, resume: str | None, crash_at: int | None = None) -> Any:
    record = Record(crash_at)
    torch.manual_seed(0)  # the same initial weights in every run of this process
    detailed = crash_at is not None or strategy == "fsdp_async"  # rows and checkpoint visibility
    offload = strategy.endswith("_optoffload")  # "<strategy>_optoffload": with cfg.optimizer_offload
    strategy = strategy.removesuffix("_optoffload")
    if strategy == "fsdp_async":
        strategy = dict(type="FSDPStrategy", async_save=True)
    runner = Runner(
        model=Net(), work_dir=work_dir, strategy=strategy,
        train_dataloader=dict(batch_size=GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", 1)), dataset=dataset(),
                              sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=False, max_iters=9),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2)),
        default_hooks=dict(checkpoint=dict(interval=4, by_epoch=False), logger=dict(interval=100)),
        custom_hooks=[record], randomness=dict(seed=0), resume=resume or False,
        cfg=dict(optimizer_offload=offload),
    )
    try:
        runner.train()
    except RuntimeError as exc:
        if crash_at is None or "simulated crash" not in str(exc):
            raise
    return dict(rows=record.rows, visible=record.visible) if detailed else record.rows


def main() -> None:
    name, runs = sys.argv[1], sys.argv[2:]
    out = {}
    for spec in runs:
        strategy, work_dir, *rest = spec.split(":")
        resume = rest[0] if rest and rest[0] else None
        crash_at = int(rest[1]) if len(rest) > 1 else None
        key = f"{strategy}:{work_dir}" + (":resumed" if resume == "auto" else "")
        out[key] = train(strategy, work_dir, resume, crash_at)
    out["world_size"] = dist.get_world_size()
    write_result(out, name)


if __name__ == "__main__":
    main()
