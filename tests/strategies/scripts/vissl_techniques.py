"""Rank script: VISSL's large-scale switches on 2 processes against one process on the same global batch.

* LARC (VISSL's larc_config, clip=False) under DDP and under DDP + ZeRO-1 (``OPTIMIZER.name: zero``);
* activation checkpointing by splits (``NUM_ACTIVATION_CHECKPOINTING_SPLITS``) under FSDP, against FSDP
  without checkpointing, with the recomputations counted and one step's peak memory measured;
* Apex O2 (bf16 model, fp32 master weights) under DDP and DDP + ZeRO-1 (which shards the masters).

Reuses the model and data of ``equivalence.py``; rank 0 also runs the one-process references.
"""

from __future__ import annotations

import time

import torch
from equivalence import DIM, GLOBAL_BATCH, STEPS, Net, data, full_params

from memfit import dist
from memfit.connector import setup
from memfit.measure import MemoryTracker
from memfit.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from memfit.testing import write_result

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # older torch: no custom collectives, the measurement keeps gloo's timing
    FSDPModule = None

LARC = dict(optimizer=dict(type="Larc", lr=0.1, momentum=0.9, weight_decay=1e-6, clip=False,
                           trust_coefficient=0.001, eps=1e-8))
SGD = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9))
SPLITS = dict(activation_checkpointing=dict(splits=3, module="blocks"))
O2 = dict(opt_level="O2", dtype="bfloat16")
MEMORY_ROWS = 512  # per rank, for peak_memory


def run(strategy, optim, *, techniques=None, precision=None, local: bool = True) -> dict:
    torch.manual_seed(0)
    model = Net()
    model, wrapper = setup(model, strategy, dict(optim), techniques, precision=precision)
    init = full_params(strategy, model)
    calls = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    wrapper.initialize_count_status(model, 0, -1)
    rank, world = (dist.get_rank(), dist.get_world_size()) if local else (0, 1)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        per_rank = GLOBAL_BATCH // world
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = model.train_step((x, y), optim_wrapper=wrapper)["loss"].float()
        losses.append(float(dist.all_reduce_mean(loss) if local else loss))
    optimizer = wrapper.optimizer
    inner = getattr(optimizer, "_optim_constructor", None) or type(optimizer)
    masters = getattr(wrapper.strategy.precision, "pairs", [])
    return {"losses": losses, "params": full_params(strategy, model), "init": init, "calls_per_step": calls,
            "optimizer": f"{type(optimizer).__name__}({inner.__name__})",
            "masters": [m.detach().flatten().tolist() for m, _ in masters],
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _released_after(call, *tensors: torch.Tensor) -> None:
    """Run a synchronous collective, then wait until gloo's worker thread has dropped its references to the
    tensors. ``wait()`` returns when the work is marked complete, before the worker drops the work and what
    it holds (measured: an all-gather's output still referenced after the call returned in 1,077 of 3,000
    calls under load). A buffer FSDP2 frees right after would then die a little later, on that thread, and a
    peak reached meanwhile would count it: one block's all-gather output (4,288 B here), seen once in CI."""
    counts = [t._use_count() for t in tensors]
    call()
    deadline = time.monotonic() + 5.0  # a reference kept for good (none in torch 2.14) must not hang the test
    while any(t._use_count() > n for t, n in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(0)


if FSDPModule is not None:

    class _SettledAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            _released_after(lambda: super(_SettledAllGather, self).__call__(output_tensor, input_tensor, group),
                            output_tensor, input_tensor)

    class _SettledReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            _released_after(
                lambda: super(_SettledReduceScatter, self).__call__(output_tensor, input_tensor, group, op),
                output_tensor, input_tensor)


def settle_collectives(model: torch.nn.Module) -> None:
    """FSDP2's collectives on this model synchronous, and their buffers released when they return (see
    :func:`_released_after`): a peak measured under gloo then does not depend on its threads' timing."""
    if FSDPModule is None:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(_SettledAllGather())
            m.set_custom_reduce_scatter(_SettledReduceScatter())


def peak_memory(strategy, techniques=None, rows: int = MEMORY_ROWS) -> dict:
    """One SGD step's peak on this rank (memfit's live-storage tracker) on ``rows`` samples, enough that the
    activations outweigh the parameters; a fresh model, so the runs above are not touched."""
    torch.manual_seed(0)
    model, wrapper = setup(Net(), strategy, dict(SGD), techniques)
    if isinstance(strategy, FSDPStrategy):
        settle_collectives(model)
    wrapper.initialize_count_status(model, 0, -1)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(rows, DIM, generator=g), torch.randint(0, 4, (rows,), generator=g)
    with MemoryTracker(model, wrapper.optimizer) as t:
        model.train_step((x, y), optim_wrapper=wrapper)
    return {"peak": t.peak_bytes, "activations": t.breakdown["activations"], "rows": rows, "hidden": 2 * DIM}


def main() -> None:
    results = {
        "larc_ddp": run(DDPStrategy(), LARC),
        "larc_zero": run(DDPStrategy(zero=True), LARC),
        "fsdp": run(FSDPStrategy(), SGD),
        "fsdp_splits": run(FSDPStrategy(), SGD, techniques=SPLITS),
        "fsdp_memory": peak_memory(FSDPStrategy()),
        "fsdp_splits_memory": peak_memory(FSDPStrategy(), SPLITS),
        "ddp_o2": run(DDPStrategy(), SGD, precision=O2),
        "ddp_zero_o2": run(DDPStrategy(zero=True), SGD, precision=O2),
    }
    if dist.get_rank() == 0:
        results["ref_larc"] = run(SingleDeviceStrategy(), LARC, local=False)
        results["ref_sgd"] = run(SingleDeviceStrategy(), SGD, local=False)
        results["ref_o2"] = run(SingleDeviceStrategy(), SGD, precision=O2, local=False)
    write_result(results)


if __name__ == "__main__":
    DDPStrategy().setup_env("pytorch")
    main()
