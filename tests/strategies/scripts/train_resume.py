"""Rank script: train with the Runner, save checkpoints, resume at this world size.

Usage: ``train_resume.py OUT_NAME RUN [RUN ...]`` where each RUN is
``STRATEGY:WORK_DIR[:RESUME_FROM]`` (STRATEGY a short name such as 'fsdp' or 'ddp_zero'). Every
run is iteration based (9 iterations over a 24-sample dataset at a global batch of 4, so it crosses
an epoch) and saves ``iter_4`` / ``iter_8`` / ``iter_9``. Rank 0 records, per iteration, the global
loss (mean over ranks) and the dataset indices every rank trained on.
"""

from __future__ import annotations

import os
import sys

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
    def __init__(self) -> None:
        self.rows: list = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        loss = float(dist.all_reduce_mean(outputs["loss"].detach().float()))
        seen = sorted(i for part in dist.all_gather_object(data_batch[2].tolist()) for i in part)
        self.rows.append([runner.iter + 1, loss, seen])


def dataset() -> list:
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(N, DIM, generator=g), torch.randint(0, 3, (N,), generator=g)
    return [(xs[i], ys[i], torch.tensor(i)) for i in range(N)]


def train(strategy: str, work_dir: str, resume: str | None) -> list:
    record = Record()
    torch.manual_seed(0)  # the same initial weights in every run of this process
    runner = Runner(
        model=Net(), work_dir=work_dir, strategy=strategy,
        train_dataloader=dict(batch_size=GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", 1)), dataset=dataset(),
                              sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=False, max_iters=9),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2)),
        default_hooks=dict(checkpoint=dict(interval=4, by_epoch=False), logger=dict(interval=100)),
        custom_hooks=[record], randomness=dict(seed=0), resume=resume or False,
    )
    runner.train()
    return record.rows


def main() -> None:
    name, runs = sys.argv[1], sys.argv[2:]
    out = {}
    for spec in runs:
        strategy, work_dir, *resume = spec.split(":")
        out[f"{strategy}:{work_dir}"] = train(strategy, work_dir, resume[0] if resume else None)
    out["world_size"] = dist.get_world_size()
    write_result(out, name)


if __name__ == "__main__":
    main()
