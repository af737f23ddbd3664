"""No host synchronisation inside a training iteration on CUDA: the loss, the gradient norm and the
loss scale stay device tensors until the logger's interval (checked with CUDA's sync debug mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.runner import Runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a CUDA device")


class ConvNet(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x, y, mode="tensor"):
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, y)} if mode == "loss" else logits


class SyncsAreErrors(Hook):
    """From the third iteration to the last but one, a host sync anywhere in an iteration (hooks included)
    raises. (The last one's invalid-loss check reads the losses not yet checked: its one sync, by design.)"""

    def __init__(self, priority: str) -> None:
        self.priority = priority
        self.checked = 0

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self.priority == "HIGHEST" and 2 <= runner.iter < runner.max_iters - 1:
            torch.cuda.set_sync_debug_mode("error")

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.priority == "LOWEST" and torch.cuda.get_sync_debug_mode():
            torch.cuda.set_sync_debug_mode("default")
            self.checked += 1


def test_an_iteration_never_waits_for_the_gpu(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 16, 16, generator=g), torch.tensor(i % 4)) for i in range(64)]
    last = SyncsAreErrors("LOWEST")
    runner = Runner(
        model=ConvNet(), work_dir=str(tmp_path),
        train_dataloader=dict(batch_size=8, dataset=data, num_workers=0),
        train_cfg=dict(by_epoch=False, max_iters=8),
        optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16", clip_grad=dict(max_norm=1.0),
                           optimizer=dict(type="AdamW", lr=1e-3)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, end=4)],
        # The invalid-loss check reads its losses at its interval (its one sync, by design): beyond this run.
        default_hooks=dict(checkpoint=None, logger=dict(interval=1000), check_invalid_loss=dict(interval=1000)),
        custom_hooks=[SyncsAreErrors("HIGHEST"), last],
    )
    try:
        runner.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert last.checked == 5
