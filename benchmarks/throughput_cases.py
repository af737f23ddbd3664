"""The cases benchmarks/gpu_throughput.py runs (its docstring describes them): the models, each case's paths
(plain loop, Runner, planned, and the Runner with one lever on) and the configs those paths build."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from throughput_paths import PlainPath, RandomImages
from timing import QUIET_HOOKS


@dataclass(frozen=True)
class Model:
    label: str
    kind: str  # 'torchvision' | 'timm'
    name: str
    size: int
    batch: int
    kwargs: dict = field(default_factory=dict)

    def module(self) -> torch.nn.Module:
        """The bare classifier, as the plain loop builds it."""
        if self.kind == "torchvision":
            import torchvision

            return torchvision.models.get_model(self.name, num_classes=1000)
        import timm

        return timm.create_model(self.name, num_classes=1000, drop_path_rate=0.0, **self.kwargs)

    def cfg(self) -> dict:
        """The same classifier as a memfit model config."""
        if self.kind == "torchvision":
            return dict(type="ImageClassifier", backbone=dict(type=self.name, num_classes=1000))
        return dict(type="TimmClassifier", model_name=self.name, num_classes=1000, drop_path_rate=0.0, **self.kwargs)


MODELS = {
    "resnet50": Model("ResNet-50 160px b128", "torchvision", "resnet50", 160, 128),
    "vit_b16": Model("ViT-B/16 224px b64", "timm", "vit_base_patch16_224", 224, 64),
    "swin_t": Model("Swin-T 224px b64", "timm", "swin_tiny_patch4_window7_224", 224, 64),
}
SMOKE_MODELS = {
    "resnet50": Model("ResNet-18 32px b4 (smoke)", "torchvision", "resnet18", 32, 4),
    "vit_b16": Model("ViT-Ti 32px b4 (smoke)", "timm", "vit_tiny_patch16_224", 32, 4, dict(img_size=32)),
    "swin_t": Model("Swin (2 stages of Swin-T, 64 px, b4; smoke)", "timm", "swin_tiny_patch4_window7_224", 64, 4,
                    dict(img_size=64, depths=(2, 2), num_heads=(3, 6))),
}


def _top(**keys: Any):
    return lambda cfg: {**cfg, **keys}


def _cudnn_benchmark(cfg: dict) -> dict:
    return {**cfg, "env_cfg": {**(cfg.get("env_cfg") or {}), "cudnn_benchmark": True}}


def _then(*edits: Any):
    def edit(cfg: dict) -> dict:
        for one in edits:
            cfg = one(cfg)
        return cfg
    return edit


def _fused(cfg: dict) -> dict:
    ow = cfg["optim_wrapper"]
    return {**cfg, "optim_wrapper": {**ow, "optimizer": {**ow["optimizer"], "fused": True}}}


@dataclass
class Spec:
    name: str
    kind: str  # 'plain' | 'runner' | 'planned'
    edit: Any = None  # Runner config -> Runner config with the lever on
    base: str | None = None  # the path a lever is compared with


@dataclass
class Case:
    name: str
    model: str
    dtype: str  # 'bf16' | 'fp32'
    data: str  # 'memory' | 'shapes'
    specs: list[Spec]
    min_s: float  # skipped when less time than this is left (GPU seconds; a tenth under --smoke)
    interleave: bool = True
    short: bool = False  # fewer steps: a pair for one lever's factor


PLAIN, RUNNER, PLANNED = Spec("plain", "plain"), Spec("memfit Runner", "runner"), Spec("memfit planned", "planned")


def _lever(name: str, edit: Any) -> Spec:
    return Spec(name, "runner", edit, base="memfit Runner")


CASES = [
    Case("resnet50 bf16", "resnet50", "bf16", "memory", [
        PLAIN, RUNNER, PLANNED, _lever("+channels_last", _top(channels_last=True)),
        _lever("+cudnn_benchmark", _cudnn_benchmark), _lever("+fused", _fused)], 40),
    Case("vit_b16 bf16", "vit_b16", "bf16", "memory", [PLAIN, RUNNER, PLANNED, _lever("+fused", _fused)], 35),
    Case("swin_t bf16", "swin_t", "bf16", "memory", [PLAIN, RUNNER, PLANNED], 30),
    Case("resnet50 bf16 ShapesDataset", "resnet50", "bf16", "shapes", [PLAIN, RUNNER], 20, interleave=False),
    Case("resnet50 fp32", "resnet50", "fp32", "memory", [
        RUNNER, _lever("+tf32", _top(tf32=True)), _lever("tf32=False", _top(tf32=False))], 25, short=True),
    Case("vit_b16 fp32", "vit_b16", "fp32", "memory", [RUNNER, _lever("+tf32", _top(tf32=True))], 25, short=True),
]
WHOLE = dict(regional=False)  # the whole model in one graph: one compiled call a step instead of one per block
# With --compile, first: each model's compiled paths beside the plain loop, and the planner allowed to compile.
COMPILE_CASES = [
    Case("resnet50 bf16 compiled", "resnet50", "bf16", "memory", [
        PLAIN, RUNNER, PLANNED, _lever("+compile", _top(compile=True)),
        _lever("+channels_last+fused+compile", _then(_top(channels_last=True, compile=True), _fused)),
        _lever("+channels_last+fused+compile whole", _then(_top(channels_last=True, compile=WHOLE), _fused))], 150),
    Case("vit_b16 bf16 compiled", "vit_b16", "bf16", "memory", [
        PLAIN, RUNNER, PLANNED, _lever("+compile", _top(compile=True)),
        _lever("+fused+compile", _then(_top(compile=True), _fused)),
        _lever("+fused+compile whole", _then(_top(compile=WHOLE), _fused))], 110),
]


def dataset_cfg(model: Model, data: str) -> dict:
    if data == "shapes":
        return dict(type="ShapesDataset", image_size=model.size, num_classes=10, num_samples=100_000)
    return dict(type=RandomImages, image_size=model.size)


def runner_cfg(model: Model, case: Case, workers: int, cuda: bool) -> dict:
    """The config a user writes for the Runner path (work_dir and the timing hook are added later)."""
    optimizer = dict(type="AdamW", lr=1e-3)
    ow = dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer=optimizer) if case.dtype == "bf16" else \
        dict(type="OptimWrapper", optimizer=optimizer)
    return dict(
        model=model.cfg(), optim_wrapper=ow, train_cfg=dict(by_epoch=False, max_iters=10**6),
        train_dataloader=dict(batch_size=model.batch, num_workers=workers, pin_memory=cuda,
                              persistent_workers=workers > 0, drop_last=True,
                              sampler=dict(type="DefaultSampler", shuffle=True), dataset=dataset_cfg(model, case.data)),
        default_hooks=QUIET_HOOKS, log_level="WARNING", randomness=dict(seed=0))


def plain_path(model: Model, case: Case, workers: int, device: torch.device, flags: tuple) -> PlainPath:
    from torch.utils.data import DataLoader

    def loader() -> DataLoader:
        if case.data == "shapes":
            from memfit.data import ShapesDataset

            dataset = ShapesDataset(image_size=model.size, num_classes=10, num_samples=100_000)
        else:
            dataset = RandomImages(model.size)
        return DataLoader(dataset, batch_size=model.batch, shuffle=True, num_workers=workers,
                          pin_memory=device.type == "cuda", drop_last=True, persistent_workers=workers > 0)

    dtype = torch.bfloat16 if case.dtype == "bf16" else None
    return PlainPath("plain", model.module, loader, model.batch, dtype, device, flags)

