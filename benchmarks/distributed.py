"""Per-rank peak memory of one training step: DDP vs ZeRO-1 vs FSDP vs FSDP + CPU offload.

Run with ``torchrun --nproc-per-node 2 benchmarks/distributed.py`` (CPU: gloo; on GPUs the same).
Each strategy trains a stack of MLP blocks with AdamW for two steps (the second one, with optimizer
state allocated, is measured by memfit's MemoryTracker); rank 0 prints the peak and its breakdown
per rank. Expected on N ranks (P = parameter bytes): DDP holds P params + P grads + 2P Adam state;
ZeRO-1 cuts the Adam state to 2P/N; FSDP shards all three to ~P/N each plus one gathered block;
FSDP + offload keeps the shards in host memory (on CPU both sides are the same memory, so the
numbers match FSDP; on CUDA the device peak falls to the gathered block and activations).
"""

from __future__ import annotations

import argparse

import torch
from models import Block
from torch import nn

from memfit import dist
from memfit.connector import setup
from memfit.measure import MB, MemoryTracker
from memfit.model import BaseModel
from memfit.strategies import DDPStrategy, FSDPStrategy


class Net(BaseModel):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])

    def forward(self, x, mode="tensor"):
        out = self.blocks(x)
        return dict(loss=out.float().pow(2).mean()) if mode == "loss" else out


def measure(name: str, strategy, dim: int, depth: int, batch: int) -> dict:
    torch.manual_seed(0)
    model, wrapper = setup(Net(dim, depth), strategy, dict(optimizer=dict(type="AdamW", lr=1e-3)))
    wrapper.initialize_count_status(model, 0, -1)
    x = torch.randn(batch, dim, device=strategy.device)
    model.train_step((x,), optim_wrapper=wrapper)  # step 1 allocates the optimizer state
    optimizer = getattr(wrapper.optimizer, "optim", wrapper.optimizer)  # ZeRO: the local optimizer
    with MemoryTracker(model, optimizer, device=strategy.device) as t:
        model.train_step((x,), optim_wrapper=wrapper)
    row = {"strategy": name, "rank": dist.get_rank(), "peak": t.peak_bytes, **t.breakdown}
    return row


def deepspeed_rows(batch: int) -> dict:
    """DeepSpeed ZeRO stages and offload (the memfit[deepspeed] extra), measured the same way."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {}
    from memfit.strategies import DeepSpeedStrategy

    # DeepSpeed's default buckets hold 5e8 elements (2 GB in fp32) whatever the model's size; sized
    # here to ~8 MB, as one would for a small model (docs/deepspeed.md).
    buckets = dict(reduce_bucket_size=2_000_000, allgather_bucket_size=2_000_000,
                   stage3_prefetch_bucket_size=2_000_000)

    def make(**zero):
        def build():
            strategy = DeepSpeedStrategy(zero_optimization={**buckets, **zero})
            strategy.setup_env("pytorch")
            strategy.set_micro_batch_size(batch)
            return strategy
        return build

    cpu = dict(device="cpu")
    return {
        "DS ZeRO-1": make(stage=1),
        "DS ZeRO-2": make(stage=2),
        "DS ZeRO-3": make(stage=3),
        "DS Z2 + offload": make(stage=2, offload_optimizer=cpu),
        "DS Z3 + offload": make(stage=3, offload_optimizer=cpu, offload_param=cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    def ready(strategy):
        # Joins torchrun's process group (the first time) and sets the strategy's device: without it
        # a strategy stays on the CPU, which fails on CUDA (an NCCL group).
        strategy.setup_env("pytorch")
        return strategy

    strategies = {
        "DDP": lambda: ready(DDPStrategy()),
        "DDP + ZeRO-1": lambda: ready(DDPStrategy(zero=True)),
        "FSDP": lambda: ready(FSDPStrategy()),
        "FSDP + offload": lambda: ready(FSDPStrategy(cpu_offload=True)),
    }
    strategies.update(deepspeed_rows(args.batch))
    rows = []
    for name, make in strategies.items():
        rows += dist.all_gather_object(measure(name, make(), args.dim, args.depth, args.batch))
    if dist.is_main_process():
        params = sum(p.numel() for p in Net(args.dim, args.depth).parameters()) * 4
        print(f"world size {dist.get_world_size()}, parameters {params / MB:.1f} MB (fp32), AdamW, "
              f"batch {args.batch} per rank; per-rank peak of a training step in MB")
        cols = ("parameters", "gradients", "optimizer_state", "activations", "inputs")
        print(f"| {'strategy':<15}| rank | {'peak':>7} | " + " | ".join(f"{c:>15}" for c in cols) + " |")
        print("|" + "-" * 16 + "|------|---------|" + "|".join("-" * 17 for _ in cols) + "|")
        for r in rows:
            print(f"| {r['strategy']:<15}| {r['rank']:>4} | {r['peak'] / MB:>7.1f} | "
                  + " | ".join(f"{r[c] / MB:>15.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
