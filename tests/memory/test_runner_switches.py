"""The seeds' memory switches through the Runner: applied, logged, and exact end to end."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.model import BaseModel
from memfit.runner import Runner


class ConvNet(BaseModel):
    """Conv-BN blocks with BN kept in eval mode (MMDetection's norm_eval=True) and a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.backbone = nn.Sequential(block(3, 8), block(8, 16), nn.MaxPool2d(2), block(16, 16))
        self.head = nn.Linear(16, 2)
        for m in self.backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, img, label, mode="tensor", **_):
        logits = self.head(self.backbone(img).mean((2, 3)))
        if mode == "loss":
            return {"loss": nn.functional.cross_entropy(logits.float(), label)}
        return logits.softmax(-1), label


def _train(work_dir, cfg=None, **optim):
    runner = Runner(
        model=ConvNet(), work_dir=work_dir,
        train_dataloader=dict(batch_size=8, dataset=dict(type="ShapesDataset", num_samples=48, image_size=16,
                                                         num_classes=2)),
        train_cfg=dict(by_epoch=False, max_iters=6),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05, momentum=0.9), **optim),
        default_hooks=dict(logger=dict(interval=1), checkpoint=None),
        randomness=dict(seed=0), cfg=cfg,
    )
    runner.train()
    rows = [json.loads(x) for x in next(Path(work_dir).glob("*/scalars.jsonl")).read_text().splitlines()]
    return [r["loss"] for r in rows], runner


def test_all_switches_together_match_the_plain_run(caplog):
    plain, _ = _train("plain")
    cfg = dict(activation_checkpointing=["backbone.0", "backbone.3"], efficient_conv_bn_eval=["backbone"],
               activation_offload=["backbone.1"], optimizer_in_backward=True)
    with caplog.at_level("INFO", logger="memfit"):
        switched, runner = _train("switched", cfg=cfg)
    assert "Enabling efficient_conv_bn_eval for 3 conv-bn pairs in backbone" in caplog.text
    assert "activation checkpointing on 2 modules" in caplog.text.lower()
    # Folding BN into the conv changes rounding only: equal within 1e-5.
    torch.testing.assert_close(switched, plain, rtol=1e-5, atol=1e-5)
    assert type(runner.optim_wrapper.optimizer).__name__ == "OptimizerInBackward"


def test_fp32_islands_and_memory_monitor(caplog):
    with caplog.at_level("INFO", logger="memfit"):
        losses, runner = _train("amp", cfg=dict(memory_monitor=True), type="AmpOptimWrapper", dtype="bfloat16",
                                fp32_modules=["head"])
    assert "fp32 islands under autocast: head" in caplog.text
    rows = [json.loads(x) for x in next(Path("amp").glob("*/scalars.jsonl")).read_text().splitlines()]
    assert all(r["memory/peak_mb"] > 0 for r in rows)
    device = runner.device
    with torch.autocast(device.type, torch.bfloat16):
        out = runner.model.head(torch.randn(2, 16, device=device))
    assert out.dtype is torch.float32


def test_optimizer_in_backward_refuses_accumulation():
    with pytest.raises(ConfigError, match="accumulative_counts=1"):
        _train("bad", cfg=dict(optimizer_in_backward=True), accumulative_counts=2)
