"""Rank script: DeepSpeed ZeRO through the Runner against a single-process reference.

Usage: ``ds_equivalence.py CASE [CASE ...]``; a CASE is ``STAGE-PRECISION-OFFLOAD-K`` with
PRECISION ``fp32`` (OptimWrapper) or ``amp`` (AmpOptimWrapper bf16 -> DeepSpeed torch_autocast),
OFFLOAD ``none``/``opt``/``all`` (optimizer, or optimizer and parameters) and K the accumulative
counts. Every rank records the batches it trained on; the reference replays the same global batches
in one process with plain torch (same init, AdamW, the same autocast), so the comparison is against
the single-process run of the same samples. Rank 0 writes, per case, the DeepSpeed losses (mean over
ranks), the reference losses and the largest parameter difference after training.
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
from memfit.runner import Runner
from memfit.testing import RecordSteps, classification_data, reference_run, write_result

DIM, N, MICRO, ITERS, LR = 8, 48, 4, 6, 1e-2


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 3)

    def forward(self, x, y, mode="tensor"):
        out = self.head(self.body(x))
        return dict(loss=F.cross_entropy(out.float(), y)) if mode == "loss" else (out, y)


class Record(RecordSteps, Hook):
    """The batches this rank trained on and the global loss of every micro-step."""


def dataset() -> list:
    return classification_data(N, DIM)


def strategy_cfg(stage: int, offload: str) -> dict:
    zero: dict = dict(stage=stage)
    if offload in ("opt", "all"):
        zero["offload_optimizer"] = dict(device="cpu")
    if offload == "all":
        zero["offload_param"] = dict(device="cpu")
    return dict(type="DeepSpeedStrategy", zero_optimization=zero)


def reference(init: dict, batches: list, k: int, amp: bool) -> tuple[list[float], dict]:
    model = Net()
    model.load_state_dict(init)
    return reference_run(model, batches, k, amp, LR)


def run_case(case: str, work_root: str) -> dict:
    stage, precision, offload, k = case.split("-")
    stage, k = int(stage), int(k)
    torch.manual_seed(0)
    model = Net()
    init = copy.deepcopy(model.state_dict())
    wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16") if precision == "amp" else dict(type="OptimWrapper")
    record = Record()
    runner = Runner(
        model=model, work_dir=os.path.join(work_root, case), strategy=strategy_cfg(stage, offload),
        train_dataloader=dict(batch_size=MICRO, dataset=dataset(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=False, max_iters=ITERS),
        optim_wrapper=dict(**wrapper, optimizer=dict(type="AdamW", lr=LR), accumulative_counts=k),
        default_hooks=dict(checkpoint=None, logger=dict(interval=100)), custom_hooks=[record],
        randomness=dict(seed=0),
    )
    runner.train()
    engine = runner.strategy.engine
    trained = runner.strategy.full_state_dict(runner.model)
    batches = [list(step) for step in zip(*dist.all_gather_object(record.batches))]
    ref_losses, ref_state = reference(init, batches, k, precision == "amp")
    diff = max(float((trained[n].float() - ref_state[n].float()).abs().max()) for n in sorted(ref_state))
    moved = max(float((ref_state[n] - init[n]).abs().max()) for n in sorted(init))
    trace = None
    if stage == 3:  # ZeRO-3's prefetch trace: recorded once, then complete (the routed forward runs its hooks once)
        coord = engine.optimizer.parameter_offload.get_param_coordinator()
        trace = coord.is_complete_trace()
    return dict(losses=record.losses, ref_losses=ref_losses, param_diff=diff, param_moved=moved, trace=trace,
                zero_stage=engine.zero_optimization_stage(), autocast=bool(engine.torch_autocast_enabled()),
                offload_optimizer=bool(engine.zero_cpu_offload()), optimizer=type(engine.optimizer).__name__,
                param_dtype=str(next(engine.module.parameters()).dtype),
                global_steps=int(engine.global_steps), micro_batch=engine.train_micro_batch_size_per_gpu(),
                gas=engine.gradient_accumulation_steps())


def main() -> None:
    work_root = os.environ["MEMFIT_TEST_OUT"]
    out = {case: run_case(case, work_root) for case in sys.argv[1:]}
    out["world_size"] = dist.get_world_size()
    write_result(out)
    dist.barrier()


if __name__ == "__main__":
    main()
