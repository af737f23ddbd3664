"""Rank script: every distributed strategy against a one-process run on the same global batch.

Each variant builds the same tiny model (same seed), prepares it with its strategy and trains a
few steps on this rank's share of a fixed global batch; it records the global loss (mean over
ranks) per step and the final full parameters. Rank 0 also runs the single-process reference on
the whole global batch, and the clipped run in plain torch (``torch_clipped``). One launch covers all
variants (a torchrun start costs seconds of imports).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from memfit import dist
from memfit.connector import setup
from memfit.model import BaseModel
from memfit.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from memfit.testing import write_result

GLOBAL_BATCH, STEPS, DIM = 8, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(BaseModel):
    def __init__(self, frozen_stem: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(DIM, 4)
        if frozen_stem:
            self.stem.requires_grad_(False)

    def forward(self, x, y, mode="tensor"):
        out = self.head(self.blocks(self.stem(x)))
        return dict(loss=F.cross_entropy(out.float(), y)) if mode == "loss" else out


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def full_params(strategy, model) -> dict[str, list]:
    """Full parameters (gathered from shards) as lists, on every rank."""
    out = {}
    for name, p in sorted(model.named_parameters()):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().flatten().tolist()
    return out


def run(strategy, optim, *, accum: int = 1, frozen: bool = False, techniques=None, local: bool = True,
        record_sync: bool = False, offload: bool = False) -> dict:
    """Train STEPS steps; ``local``: this rank's share of the global batch, else the whole batch."""
    torch.manual_seed(0)
    model = Net(frozen_stem=frozen)
    model, wrapper = setup(model, strategy, dict(optim, accumulative_counts=accum), techniques,
                           optimizer_offload=offload)
    init = full_params(strategy, model)
    wrapper.initialize_count_status(model, 0, -1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if local else (0, 1)
    losses, synced, norms = [], [], []
    for step in range(STEPS):
        x, y = data(step)
        per_rank = GLOBAL_BATCH // world
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        micro = per_rank // accum
        total = torch.zeros(())
        for i in range(accum):
            log = model.train_step((x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]), optim_wrapper=wrapper)
            total += log["loss"].float() / accum
            if record_sync and i == 0 and accum > 1:
                # After a non-final micro-step no gradient may have been reduced across ranks.
                synced.append(_grad_state(strategy, model))
        if local:
            total = dist.all_reduce_mean(total)
        losses.append(float(total))
        if "grad_norm" in wrapper.log_scalars():
            norms.append(float(wrapper.log_scalars()["grad_norm"]))
    out = {"losses": losses, "params": full_params(strategy, model), "init": init,
           "units": getattr(strategy, "units", []), "grad_norms": norms}
    if record_sync:
        out["after_first_micro"] = synced
    return out


def torch_clipped(max_norm: float, lr: float) -> dict:
    """The clipped run without memfit: the same model and global batches, torch's AdamW and
    ``clip_grad_norm_``; ``grad_norms``: the total norm of all gradients before clipping."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data(step)
        loss = model(x, y, mode="loss")["loss"]
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))))
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": full_params(None, model), "grad_norms": norms}


def _grad_state(strategy, model) -> str:
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(strategy, FSDPStrategy):
        # FSDP2 keeps unsynced gradients unsharded and unreduced; the sharded .grad appears at the sync.
        return "no-grad" if all(p.grad is None for p in params) else "reduced"
    # DDP: unsynced gradients differ between ranks (different data); synced ones are equal.
    g = torch.cat([p.grad.flatten() for p in params])
    gathered = [torch.zeros_like(g) for _ in range(dist.get_world_size())]
    tdist.all_gather(gathered, g)
    return "equal" if all(torch.equal(gathered[0], t) for t in gathered) else "different"


def main() -> None:
    sgd = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9))
    adamw = dict(optimizer=dict(type="AdamW", lr=1e-2))
    clipped = dict(adamw, clip_grad=dict(max_norm=0.05))
    bf16 = dict(adamw, type="AmpOptimWrapper", dtype="bfloat16")

    ckpt = dict(activation_checkpointing=dict(types=["Block"]))

    results: dict = {}
    variants = {
        "ddp": (lambda: DDPStrategy(), sgd, {}),
        "ddp_zero": (lambda: DDPStrategy(zero=True), adamw, {}),
        "ddp_zero_wrapper": (lambda: DDPStrategy(), dict(adamw, type="ZeroOptimWrapper"), {}),
        "ddp_accum": (lambda: DDPStrategy(), sgd, dict(accum=2, record_sync=True)),
        "fsdp": (lambda: FSDPStrategy(), adamw, {}),
        "ddp_clip": (lambda: DDPStrategy(), clipped, {}),
        "zero_clip": (lambda: DDPStrategy(zero=True), clipped, {}),
        "fsdp_clip": (lambda: FSDPStrategy(), clipped, {}),
        "fsdp_offload": (lambda: FSDPStrategy(cpu_offload=True), adamw, {}),
        "fsdp_bf16": (lambda: FSDPStrategy(mixed_precision=dict(param_dtype="bfloat16", reduce_dtype="float32")),
                      adamw, {}),
        "fsdp_amp": (lambda: FSDPStrategy(), bf16, {}),
        "fsdp_ckpt": (lambda: FSDPStrategy(), adamw, dict(techniques=ckpt)),
        "fsdp_frozen": (lambda: FSDPStrategy(), adamw, dict(frozen=True)),
        "fsdp_accum": (lambda: FSDPStrategy(), sgd, dict(accum=2, record_sync=True)),
        "fsdp_names": (lambda: FSDPStrategy(wrap_modules=["blocks.0", "head"]), adamw, {}),
        # Optimizer offload (state and step on the host) under each strategy that takes it.
        "ddp_optoffload": (lambda: DDPStrategy(), adamw, dict(offload=True)),
        "fsdp_optoffload": (lambda: FSDPStrategy(), adamw, dict(offload=True)),
        "fsdp_clip_optoffload": (lambda: FSDPStrategy(), clipped, dict(offload=True)),
        "zero2_accum_optoffload": (lambda: FSDPStrategy(reshard_after_forward=False), adamw,
                                   dict(accum=2, offload=True)),
        "zero2_accum": (lambda: FSDPStrategy(reshard_after_forward=False), adamw, dict(accum=2)),
    }
    only = sys.argv[1:]
    for name, (make, optim, kw) in variants.items():
        if only and name not in only:
            continue
        results[name] = run(make(), optim, **kw)
    if dist.get_rank() == 0:  # one-process references on the global batch, in a process of its own
        refs = {"sgd": (sgd, {}), "adamw": (adamw, {}), "clipped": (clipped, {}), "bf16": (bf16, {}),
                "adamw_frozen": (adamw, dict(frozen=True))}
        for name, (optim, kw) in refs.items():
            results[f"ref_{name}"] = run(SingleDeviceStrategy(), optim, local=False, **kw)
        results["torch_clipped"] = torch_clipped(clipped["clip_grad"]["max_norm"], adamw["optimizer"]["lr"])
    write_result(results)


if __name__ == "__main__":
    DDPStrategy().setup_env("pytorch")
    main()
