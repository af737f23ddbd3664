"""Rank script: the speed levers under DDP and FSDP2 on 2 CPU processes (tests/speed/test_strategies.py).

Each variant builds the same tiny model (same seed), sets it up through ``memfit.connector.setup`` with its
strategy and levers, and trains a few steps on this rank's share of a fixed global batch; it records the
global loss per step and the final full parameters. ``torch.compile`` runs with the ``aot_eager`` backend:
dynamo's tracing and AOTAutograd (what meets the strategies' hooks and DTensors) without inductor's code
generation, which tests/speed/test_compile.py covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit import dist
from memfit.connector import setup
from memfit.model import BaseModel
from memfit.speed import compiled_modules
from memfit.strategies import DDPStrategy, FSDPStrategy
from memfit.testing import write_result

GLOBAL_BATCH, STEPS, DIM = 8, 3, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(DIM, 4)

    def forward(self, x, y, mode="tensor"):
        out = self.head(self.blocks(self.stem(x)))
        return dict(loss=F.cross_entropy(out, y)) if mode == "loss" else out


def run(strategy, optimizer: dict, compile=False, techniques=None) -> dict:
    torch.manual_seed(0)
    model, wrapper = setup(Net(), strategy, dict(optimizer=optimizer), techniques, compile=compile)
    wrapper.initialize_count_status(model, 0, -1)
    rank, per_rank = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        log = model.train_step((x[part], y[part]), optim_wrapper=wrapper)
        losses.append(float(dist.all_reduce_mean(log["loss"].detach().float())))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
              for n, p in sorted(model.named_parameters())}
    return {"losses": losses, "params": params, "compiled": compiled_modules(model)}


def main() -> None:
    sgd, adamw = dict(type="SGD", lr=0.1), dict(type="AdamW", lr=1e-2)
    eager = dict(backend="aot_eager")
    out = {
        "ddp": run(DDPStrategy(), sgd),
        "ddp_whole": run(DDPStrategy(), sgd, compile=dict(eager, regional=False)),
        "ddp_regional": run(DDPStrategy(), sgd, compile=eager),
        "fsdp": run(FSDPStrategy(), adamw),
        "fsdp_regional_ckpt": run(FSDPStrategy(), adamw, compile=eager,
                                  techniques=dict(activation_checkpointing=dict(types=["Block"]))),
        "fsdp_fused": run(FSDPStrategy(), dict(adamw, fused=True)),
        "zero1": run(DDPStrategy(zero=True), adamw),
        "zero1_fused": run(DDPStrategy(zero=True), dict(adamw, fused=True)),
    }
    write_result(out)


if __name__ == "__main__":
    main()
