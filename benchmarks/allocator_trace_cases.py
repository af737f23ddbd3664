"""The cases benchmarks/record_allocator_traces.py records (its docstring describes them): their models, the
in-memory images they train on and the Runner config each one builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from throughput_cases import Model
from throughput_paths import RandomImages

from memfit.hooks import Hook

# No checkpoints, and no LoggerHook at all: its log line of an epoch's last iteration calls
# torch.cuda.reset_peak_memory_stats, which would hide the recorded steps' peaks.
HOOKS = dict(checkpoint=None, logger=None)


MODELS = {
    "vit": Model("ViT-S/16 224px b32", "timm", "vit_small_patch16_224", 224, 32),
    "swin": Model("Swin-T 224px b16", "timm", "swin_tiny_patch4_window7_224", 224, 16),
    "resnet": Model("ResNet-50 160px b64", "torchvision", "resnet50", 160, 64),
}
DRY_MODELS = {
    "vit": Model("ViT-Ti/16 32px b2 (dry)", "timm", "vit_tiny_patch16_224", 32, 2, dict(img_size=32)),
    "swin": Model("Swin (2 stages of Swin-T) 64px b2 (dry)", "timm", "swin_tiny_patch4_window7_224", 64, 2,
                  dict(img_size=64, depths=(2, 2), num_heads=(3, 6))),
    "resnet": Model("ResNet-18 32px b2 (dry)", "torchvision", "resnet18", 32, 2),
}


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # key of MODELS
    description: str
    techniques: dict = field(default_factory=dict)  # the Runner's cfg=dict(...)
    strategy: dict | None = None
    est_s: float = 8.0  # skipped when less time than this (plus the script's RESERVE_S) is left


CASES = [
    Case("vit_s16", "vit", "timm ViT-S/16, bf16 autocast, AdamW", est_s=8),
    Case("swin_t", "swin", "timm Swin-T, bf16 autocast, AdamW", est_s=8),
    Case("resnet50", "resnet", "torchvision ResNet-50, bf16 autocast, AdamW", est_s=8),
    Case("vit_s16_ac_blocks", "vit", "ViT-S/16 with memfit's activation checkpointing of every Block",
         techniques=dict(activation_checkpointing=dict(types=["Block"])), est_s=8),
    Case("vit_s16_optimizer_offload", "vit", "ViT-S/16 with memfit's optimizer offload (AdamW on the host)",
         techniques=dict(optimizer_offload=True), est_s=10),
    Case("vit_s16_fsdp", "vit", "ViT-S/16 under memfit's FSDPStrategy (FSDP2) on one rank (nccl, world size 1)",
         strategy=dict(type="FSDPStrategy"), est_s=15),
]


def runner_cfg(case: Case, model: Model, steps: int, cuda: bool, dtype: str, work_dir: str, hook: Hook) -> dict:
    """The Runner config of a case: what a user writes, with a dataset of exactly ``steps`` batches."""
    cfg: dict[str, Any] = dict(
        model=model.cfg(), work_dir=work_dir,
        optim_wrapper=dict(type="AmpOptimWrapper", dtype=dtype, optimizer=dict(type="AdamW", lr=1e-3)) if dtype
        else dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)),
        train_cfg=dict(by_epoch=False, max_iters=steps),
        train_dataloader=dict(batch_size=model.batch, num_workers=0, pin_memory=cuda, drop_last=True,
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              dataset=dict(type=RandomImages, image_size=model.size, count=model.batch,
                                           length=model.batch * steps)),
        default_hooks=HOOKS, custom_hooks=[hook], log_level="WARNING", randomness=dict(seed=0))
    if case.techniques:
        cfg["cfg"] = dict(case.techniques)
    if case.strategy:
        cfg["strategy"] = dict(case.strategy)
    return cfg
