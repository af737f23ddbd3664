"""Rank script: the tiny DINO of tests/strategies/scripts/detection_equivalence.py under DeepSpeed ZeRO-3 on 2
ranks against one process on the same global batches (that script's model, batches, reference and training
loop; see tests/strategies_ds/test_deepspeed_detection.py).

Rank 0 trains the one-process reference before any process group exists; then both ranks train under
``DeepSpeedStrategy(zero_optimization=dict(stage=3))`` with a torch AdamW as DeepSpeed's client optimizer, and
rank 0 compares the parameters gathered from the ZeRO-3 partitions with the reference's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "strategies" / "scripts"))
from detection_equivalence import LR, PER_RANK, build_dino, global_batches, param_diffs, reference, train  # noqa: E402

from memfit import dist  # noqa: E402
from memfit.connector import setup  # noqa: E402
from memfit.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402
from memfit.testing import write_result  # noqa: E402

# DeepSpeed sizes its buckets in elements and defaults to 5e8 (2 GB in fp32): sized for a 1.4 M-parameter model.
ZERO3 = dict(stage=3, reduce_bucket_size=500_000, allgather_bucket_size=500_000, stage3_prefetch_bucket_size=500_000)


def ds_run(batches: list[list[int]], ref: dict | None) -> dict:
    """ZeRO-3 on this rank's shares; rank 0 compares the gathered parameters with ``ref``."""
    # gradient_clipping=0.0: DeepSpeed 0.19 clips at 1.0 by default, which memfit does not yet override when
    # optim_wrapper has no clip_grad; the one-process reference does not clip.
    strategy = DeepSpeedStrategy(zero_optimization=ZERO3, gradient_clipping=0.0)
    strategy.set_micro_batch_size(PER_RANK)  # the train loader's batch_size, as the Runner tells it
    model, optim = setup(build_dino(), strategy, dict(optimizer=dict(type="AdamW", lr=LR)))
    optim.initialize_count_status(model, 0, -1)
    steps = train(model, optim, batches, dist.get_rank(), dist.get_world_size())
    state = strategy.full_state_dict(model)
    engine = strategy.engine
    out = dict(losses=steps, zero_stage=engine.zero_optimization_stage(), global_steps=int(engine.global_steps),
               param_dtype=str(next(model.parameters()).dtype), numel=sum(p.ds_numel for p in model.parameters()),
               local_numel=sum(p.ds_tensor.numel() for p in model.parameters()))
    if ref is not None:
        out.update(param_diffs({n: state[n] for n in ref}, ref))
    return out


def main() -> None:
    torch.set_num_threads(1)
    batches = global_batches()
    results: dict = {"batches": batches}
    ref = None
    if int(os.environ["RANK"]) == 0:
        steps, init, ref = reference(batches)
        results["ref"] = dict(losses=steps, moved=max(float((ref[n] - init[n]).abs().max()) for n in ref))
    results["zero3"] = ds_run(batches, ref)
    results["world_size"] = dist.get_world_size()
    write_result(results)
    dist.barrier()


if __name__ == "__main__":
    main()
