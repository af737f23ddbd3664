"""Rank script: ColossalAIStrategy with the DDP plugin (what colossalai 0.5 runs on CPU).

With the argument ``gpu`` (CUDA only) it runs Gemini and LowLevelZero with HybridAdam instead: each
trains 4 iterations and a fresh runner resumed from the iteration-2 sharded checkpoint must repeat
iterations 3-4.

Runs, in one process: fp32 and ``mixed_precision='bf16'`` (torch autocast) with k=2 against a
single-process reference replaying the same global batches; a checkpoint at iteration 2 resumed
by a fresh runner that must reproduce iterations 3-4; and whether HybridAdam became a registry
name. Rank 0's result holds, per run, the losses, the reference losses and the parameter difference.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from memfit import dist
from memfit.hooks.base import Hook
from memfit.model import BaseModel
from memfit.registry import OPTIMIZERS
from memfit.runner import Runner
from memfit.testing import RecordSteps, classification_data, reference_run, write_result

DIM, N, LR = 8, 32, 1e-2
OUT = os.environ["MEMFIT_TEST_OUT"]


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x, y, mode="tensor"):
        out = self.body(x)
        return dict(loss=F.cross_entropy(out.float(), y)) if mode == "loss" else (out, y)


class Record(RecordSteps, Hook):
    """The batches this rank trained on and the global loss of every micro-step."""


def dataset() -> list:
    return classification_data(N, DIM)


def train(name: str, mixed_precision: str | None, iters: int, resume: str | bool = False, plugin: str = "ddp",
          optimizer: str = "AdamW") -> tuple[Runner, Record]:
    torch.manual_seed(0)
    record = Record()
    runner = Runner(
        model=Net(), work_dir=os.path.join(OUT, name),
        strategy=dict(type="ColossalAIStrategy", plugin=plugin, mixed_precision=mixed_precision),
        train_dataloader=dict(batch_size=4, dataset=dataset(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(optimizer=dict(type=optimizer, lr=LR), accumulative_counts=1 if plugin != "ddp" else 2),
        default_hooks=dict(checkpoint=dict(interval=2, by_epoch=False), logger=dict(interval=100)),
        custom_hooks=[record], randomness=dict(seed=0), resume=resume,
    )
    runner.train()
    return runner, record


def reference(init: dict, batches: list, amp: bool) -> tuple[list[float], dict]:
    model = Net()
    model.load_state_dict(init)
    return reference_run(model, batches, 2, amp, LR)


def main_gpu() -> None:
    out: dict = {}
    for plugin in ("gemini", "lowlevel-zero"):
        _, record = train(plugin, "bf16", iters=4, plugin=plugin, optimizer="HybridAdam")
        _, resumed = train(f"{plugin}_resumed", "bf16", iters=4, plugin=plugin, optimizer="HybridAdam",
                           resume=os.path.join(OUT, plugin, "iter_2.pth"))
        out[plugin] = dict(losses=record.losses, resumed=resumed.losses)
    write_result(out)
    dist.barrier()


def main() -> None:
    if sys.argv[1:] == ["gpu"]:
        return main_gpu()
    torch.manual_seed(0)
    init = copy.deepcopy(Net().state_dict())
    out: dict = {}
    for name, mp in (("fp32", None), ("bf16", "bf16")):
        runner, record = train(name, mp, iters=4)
        batches = [list(step) for step in zip(*dist.all_gather_object(record.batches))]
        ref_losses, ref_state = reference(init, batches, amp=mp is not None)
        state = runner.model.state_dict()
        out[name] = dict(losses=record.losses, ref_losses=ref_losses,
                         param_diff=max(float((state[k] - ref_state[k]).abs().max()) for k in sorted(ref_state)),
                         precision=runner.strategy.precision.name, model=type(runner.model).__name__,
                         plugin=type(runner.strategy.booster.plugin).__name__)
    _, resumed = train("resumed", None, iters=4, resume=os.path.join(OUT, "fp32", "iter_2.pth"))
    out["resume"] = dict(losses=resumed.losses)
    out["hybrid_adam_registered"] = "HybridAdam" in OPTIMIZERS
    write_result(out)
    dist.barrier()


if __name__ == "__main__":
    main()
