"""One optimizer step with its state added stands for two: the planner's fake runs take ``steps=1``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.model import BaseModel
from memfit.planner.fake import fake_process_group, measure_step


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU())
        self.head = nn.Linear(512, 10)

    def forward(self, x, y=None, mode="tensor"):
        out = self.head(self.blocks(x))
        return {"loss": F.cross_entropy(out.float(), y)} if mode == "loss" else out


@pytest.mark.parametrize("strategy", [None, dict(type="DDPStrategy", zero=True), dict(type="FSDPStrategy"),
                                      dict(type="FSDPStrategy", reshard_after_forward=False)],
                         ids=["single", "zero1", "fsdp", "zero2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_step_with_its_state_measures_what_two_steps_do(strategy, precision):
    """The second step's forward/backward holds what the first one held plus the optimizer state the first
    step created; its optimizer phase is the first's. Same tracked bytes (the 'step' counters aside, 4
    bytes a parameter at most) and, for a CUDA target, the same simulated allocator peaks: the one step's
    requests replayed as the second step makes them, on the segments the first left (the second step's
    fragmentation: 2 GiB more reserved for DINO Swin-L with AMP and both checkpointings, docs/planner.md)."""
    ow = dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3, foreach=True), accumulative_counts=2)
    if precision == "bf16":
        ow.update(type="AmpOptimWrapper", dtype="bfloat16")
    cfg = dict(model=Net(), strategy=strategy, optim_wrapper=ow)
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    with fake_process_group(4 if strategy else 1):
        one = measure_step(cfg, full=True, batch=batch, steps=1, cuda=True)
        two = measure_step(cfg, full=True, batch=batch, steps=2, cuda=True)
    slack = 4 * len(list(Net().parameters()))
    for a, b in ((one.peak, two.peak), (one.forward_backward.peak, two.forward_backward.peak),
                 (one.optimizer.peak, two.optimizer.peak)):
        assert abs(a - b) <= slack, (a, b)
    assert one.forward_backward.breakdown.get("optimizer_state", 0) > 0
    assert (one.cuda_allocated, one.cuda_reserved) == (two.cuda_allocated, two.cuda_reserved)
