"""The planner's per-rank peak (``predict(as_is=True)`` on fake tensors) against a real CPU run of the
same config under memfit's tracker (``measure_plan``, what ``memfit bench`` measures): within 5% over
and 3% under, for ResNet-50 (frozen BatchNorm + Conv-BN folding), ViT-B/16 (with and without block
checkpointing), Swin-B (selective checkpointing), fp32 and bf16, one process and two ranks (DDP +
ZeRO-1, FSDP2) over gloo (scripts/measured_peaks.py: rank 0's peak; gloo's reduce-scatter, which
copies its input where the tracker cannot see it, runs there allocating what NCCL's would).

Shapes are small (depth and image size cut, batch 2-4) so a real step takes well under a second; the
models keep their layer widths, so the model state is the real one per layer. SGD without momentum
holds no optimizer state: the forward/backward phase is then the peak, so the activations that
checkpointing, bf16 and Conv-BN change are in the compared figure. AdamW cases put the optimizer
phase (and ZeRO's and FSDP's sharding of the state) under test instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchvision.ops import FrozenBatchNorm2d

from memfit.planner.bench import measure_plan
from memfit.planner.devices import MiB, this_cpu
from memfit.planner.fake import build_meta_model
from memfit.planner.predict import predict
from memfit.planner.space import ModelFacts, configured_plan
from memfit.testing import launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "measured_peaks.py"
OVER, UNDER = 0.05, 0.03  # the prediction may be 5% above the real peak, 3% below it


def config(model: dict, image: int, batch: int, precision: str = "fp32", optimizer: str | dict = "SGD",
           **extra) -> dict:
    """A shapes-dataset training config around ``model`` (``extra``: strategy, techniques)."""
    optim = optimizer if isinstance(optimizer, dict) else dict(type=optimizer, lr=1e-3)
    wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer=optim) if precision == "bf16" else \
        dict(type="OptimWrapper", optimizer=optim)
    data = dict(type="ShapesDataset", image_size=image, num_classes=4, num_samples=16)
    return dict(model=model, optim_wrapper=wrapper, train_cfg=dict(by_epoch=False, max_iters=2),
                train_dataloader=dict(batch_size=batch, num_workers=0, dataset=data,
                                      sampler=dict(type="DefaultSampler", shuffle=False)), **extra)


def resnet50() -> dict:
    # FrozenBatchNorm2d: BatchNorm in eval mode for good (the detection backbones' norm_eval).
    return dict(type="ImageClassifier", backbone=dict(type="resnet50", num_classes=4, norm_layer=FrozenBatchNorm2d))


def vit_b(image: int, patch: int) -> dict:
    return dict(type="TimmClassifier", model_name="vit_base_patch16_224", num_classes=4, img_size=image,
                patch_size=patch, depth=2)


def swin_b(image: int, width: int = 32) -> dict:
    # Swin-B's block and attention code with two stages and a narrower embedding (not 128).
    return dict(type="TimmClassifier", model_name="swin_base_patch4_window7_224", num_classes=4, img_size=image,
                depths=(1, 2), embed_dim=width, num_heads=(2, 4))


BLOCK_AC = dict(activation_checkpointing=dict(types=["Block"]))
SELECTIVE_AC = dict(activation_checkpointing=dict(types=["SwinTransformerBlock"], selective=True))

SINGLE = {
    "resnet50 frozen-bn conv-bn fp32": config(resnet50(), 64, 4, efficient_conv_bn_eval=["backbone"]),
    "vit-b fp32": config(vit_b(32, 4), 32, 4),
    "vit-b fp32 ac:blocks": config(vit_b(32, 4), 32, 4, **BLOCK_AC),
    "vit-b bf16 ac:blocks": config(vit_b(32, 16), 32, 2, "bf16", **BLOCK_AC),
    "swin-b fp32 ac:selective adamw": config(swin_b(112), 112, 2, optimizer="AdamW", **SELECTIVE_AC),
    "swin-b bf16 ac:selective": config(swin_b(112), 112, 2, "bf16", **SELECTIVE_AC),
}
ZERO1 = dict(strategy=dict(type="DDPStrategy", zero=True))
# JSON-able: the rank script reads them from a file and runs them in this order.
TWO_RANKS = {
    # First: DTensor's sharding-propagation cache is then cold when SGD's second step first mul_s its momentum.
    "vit-b fsdp fp32 sgd+momentum": config(vit_b(32, 8), 32, 2, optimizer=dict(type="SGD", lr=1e-3, momentum=0.9),
                                           strategy=dict(type="FSDPStrategy")),
    "vit-b ddp+zero1 fp32 adamw": config(vit_b(32, 8), 32, 2, optimizer="AdamW", **ZERO1),
    # Activations above the model state: the forward/backward phase of the second step is the peak.
    "swin-b ddp+zero1 fp32 adamw ac:selective": config(swin_b(112, 64), 112, 2, optimizer="AdamW", **ZERO1,
                                                       **SELECTIVE_AC),
    "vit-b fsdp fp32 adamw": config(vit_b(32, 8), 32, 2, optimizer="AdamW", strategy=dict(type="FSDPStrategy")),
    "vit-b fsdp fp32 ac:blocks": config(vit_b(32, 8), 32, 2, strategy=dict(type="FSDPStrategy"), **BLOCK_AC),
}


@pytest.fixture(scope="module")
def cpu():
    return this_cpu()


def check(name: str, predicted: int, pred_breakdown: dict, real: int, real_breakdown: dict) -> None:
    """Assert the tolerance (printed with ``-s``); on failure the message holds both breakdowns side by side."""
    err = (predicted - real) / real
    print(f"{name}: predicted {predicted / MiB:.2f} MiB, real {real / MiB:.2f} MiB ({100 * err:+.2f}%)")
    rows = "\n".join(f"  {k:16s} {pred_breakdown.get(k, 0) / MiB:9.3f} {real_breakdown.get(k, 0) / MiB:9.3f}"
                     for k in sorted(set(pred_breakdown) | set(real_breakdown)))
    assert -UNDER <= err <= OVER, (f"{name}: predicted {predicted / MiB:.2f} MiB, real {real / MiB:.2f} MiB "
                                   f"({100 * err:+.2f}%)\n  {'':16s} {'predicted':>9s} {'real':>9s}\n{rows}")


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_one_process(name, cpu, tmp_path):
    cfg = {**SINGLE[name], "work_dir": str(tmp_path)}
    pred = predict(cfg, device=cpu, as_is=True)
    assert len(pred.results) == 1 and pred.results[0].source == "measured"
    result = pred.results[0]
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    real = measure_plan(cfg, configured_plan(cfg, facts, cuda=False), facts, steps=1)
    check(name, result.peak_bytes, result.breakdown, real.peak_bytes, real.breakdown)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Rank 0's and rank 1's measured peaks of every two-rank case, from one launch."""
    out = tmp_path_factory.mktemp("planner_accuracy")
    cases = out / "cases.json"
    cases.write_text(json.dumps({n: {**c, "work_dir": str(out)} for n, c in TWO_RANKS.items()}))
    proc = launch(SCRIPT, nproc=2, args=[str(cases)], out_dir=out, timeout=240)
    return read_results(out, 2, proc)


# Known failures, kept at the tolerance until memfit is fixed (strict: a fix makes them fail, to be unmarked).
KNOWN: dict[str, str] = {}  # case -> why it fails (strict xfail); fixed: DDP buckets added twice, DTensor metadata


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n]))
                                  if n in KNOWN else n for n in sorted(TWO_RANKS)])
def test_two_ranks(name, two_ranks, cpu, tmp_path):
    cfg = {**TWO_RANKS[name], "work_dir": str(tmp_path)}
    pred = predict(cfg, device=cpu, world_size=2, as_is=True).results[0]
    real = two_ranks[0][name]
    check(name, pred.peak_bytes, pred.breakdown, real["peak"], real["breakdown"])
