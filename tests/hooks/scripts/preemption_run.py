"""Rank script: SIGTERM reaches rank 1 only, after iteration 5; both ranks must stop there, save and resume.

Usage: ``preemption_run.py TMP STRATEGY...`` (STRATEGY 'ddp', or 'fsdp_async': FSDP with ``async_save=True``,
whose background save must be finalized before the run stops). Per strategy, three runs in this process: an
uninterrupted one, the signalled one and the resumed one. Each rank writes its own per-iteration losses,
what the stop reported and whether the final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import Preempted
from memfit.hooks.base import Hook
from memfit.model import BaseModel
from memfit.runner import Runner
from memfit.testing import SignalAt, write_result


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.drop, self.head = nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 3)

    def forward(self, x, y, mode="tensor"):
        out = self.head(self.drop(self.fc(x).tanh()))
        return dict(loss=F.cross_entropy(out, y)) if mode == "loss" else (out, y)


class Losses(Hook):
    def __init__(self) -> None:
        self.rows: list[float] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.rows.append(outputs["loss"].item())


def dataset() -> list:
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    return [(xs[i], ys[i]) for i in range(24)]


def train(strategy: str, work_dir: str, hooks: list, resume: bool = False) -> torch.nn.Module:
    runner = Runner(
        model=Net(), work_dir=work_dir,
        strategy=dict(type="FSDPStrategy", async_save=True) if strategy == "fsdp_async" else None,
        train_dataloader=dict(batch_size=2, dataset=dataset(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=True, max_epochs=2),  # 6 iterations an epoch
        # DDP stops inside an accumulation window (its partial gradients are saved); FSDP does not, as
        # an FSDP checkpoint saved inside a window does not resume exactly (with or without preemption).
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2), accumulative_counts=2 if strategy == "ddp" else 1),
        default_hooks=dict(checkpoint=dict(interval=1), logger=dict(interval=100)),
        custom_hooks=hooks, randomness=dict(seed=0), resume=resume,
    )
    runner.train()
    return runner.model


def weights(model: torch.nn.Module) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def run(tmp: str, strategy: str) -> dict:
    full = Losses()
    expected = weights(train(strategy, f"{tmp}/{strategy}_full", [full]))
    first, stop = Losses(), {}
    try:
        train(strategy, f"{tmp}/{strategy}_run", [first, SignalAt(at=5, signal="SIGTERM", rank=1)])
    except Preempted as exc:
        ranks = str(exc).split(" received ", 1)[1].split(";")[0]
        stop = dict(signal=exc.signal_name, iteration=exc.iteration, ranks=ranks,
                    saved=os.path.exists(exc.checkpoint))
    resumed = Losses()
    got = weights(train(strategy, f"{tmp}/{strategy}_run", [resumed], resume=True))
    equal = all(torch.equal(expected[k], got[k]) for k in expected)
    return dict(full=full.rows, first=first.rows, resumed=resumed.rows, preempted=stop, weights_equal=equal)


def main() -> None:
    tmp, strategies = sys.argv[1], sys.argv[2:]
    write_result({s: run(tmp, s) for s in strategies})


if __name__ == "__main__":
    main()
