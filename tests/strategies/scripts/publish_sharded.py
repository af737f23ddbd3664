"""Rank script: FSDP training on 2 ranks with CheckpointHook ``published_keys``; the last checkpoint is
a sharded (DCP) directory, published as one file.

Usage: ``publish_sharded.py RUN [RUN ...]``, each RUN ``WORK_DIR:ASYNC:KEYS`` (ASYNC '0'/'1': ``async_save``;
KEYS comma-separated published_keys), trained one after the other in this process. Every rank writes
the names of the work dirs' entries after training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from memfit.model import BaseModel
from memfit.runner import Runner
from memfit.testing import write_result


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, mode="tensor"):
        out = self.head(self.blocks(x))
        return dict(loss=F.cross_entropy(out, y)) if mode == "loss" else (out, y)


def train(work_dir: str, background: bool, keys: list[str]) -> None:
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.manual_seed(0)
    runner = Runner(
        model=Net(), work_dir=work_dir, strategy=dict(type="FSDPStrategy", async_save=background),
        train_dataloader=dict(batch_size=2, dataset=[(xs[i], ys[i]) for i in range(8)]),
        train_cfg=dict(by_epoch=False, max_iters=2), optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2)),
        default_hooks=dict(checkpoint=dict(interval=2, by_epoch=False, published_keys=keys),
                           logger=dict(interval=100)),
        randomness=dict(seed=0),
    )
    runner.train()


def main() -> None:
    out = {}
    for spec in sys.argv[1:]:
        work_dir, background, keys = spec.split(":")
        train(work_dir, background == "1", keys.split(","))
        out[work_dir] = sorted(p.name for p in Path(work_dir).iterdir())
    write_result(out)


if __name__ == "__main__":
    main()
