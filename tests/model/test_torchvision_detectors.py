"""torchvision detectors on timm backbones: the BaseModel contract, original-pixel predictions, exact switches."""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.data.shapes import ShapesDataset
from memfit.errors import ConfigError, ConfigTypeError
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.memory.conv_bn import apply_efficient_conv_bn_eval
from memfit.registry import MODELS

SIZE = 64
SWIN = dict(model_name="swin_tiny_patch4_window7_224", embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8),
            drop_path_rate=0.0)


def _batch(n: int = 2, scale: float = 1.0) -> tuple[torch.Tensor, list[dict]]:
    ds = ShapesDataset(num_samples=n, image_size=SIZE, num_classes=3, max_shapes=3)
    items = [ds[i] for i in range(n)]
    samples = [dict(img_id=i, img_shape=(SIZE, SIZE), ori_shape=(round(SIZE / scale),) * 2, scale_factor=(scale, scale),
                    gt_instances=dict(bboxes=it["boxes"], labels=it["labels"])) for i, it in enumerate(items)]
    return torch.stack([it["img"] for it in items]), samples


def _build(kind: str, backbone: dict | None = None, **kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = {} if kind == "FCOS" else dict(anchor_sizes=(8, 16, 32, 64, 128))
    return MODELS.build(dict(type=kind, backbone=backbone or dict(model_name="resnet18"), num_classes=3,
                             out_channels=32, **extra, **kwargs))


# Untrained, RetinaNet and FCOS score every box below torchvision's 0.05 threshold: with none, each image keeps
# its top-scoring boxes (100-300 here), so the label range and the scale-factor mapping are checked on boxes.
NO_SCORE_THRESHOLD = {"FasterRCNN": dict(box_score_thresh=0.0), "RetinaNet": dict(score_thresh=0.0),
                      "FCOS": dict(score_thresh=0.0)}


@pytest.mark.parametrize("kind", ["FasterRCNN", "RetinaNet", "FCOS"])
def test_loss_and_predict_follow_the_contract(kind):
    model = _build(kind, **NO_SCORE_THRESHOLD[kind])
    inputs, samples = _batch()
    losses = model(inputs, samples, mode="loss")
    assert losses and all("loss" in k and v.dim() == 0 and torch.isfinite(v) for k, v in losses.items())
    loss, _ = model.parse_losses(losses)
    loss.backward()
    assert model.backbone.body.layer4[0].bn2.weight.grad.abs().sum() > 0  # timm zero-inits bn2: conv1 starts at 0

    model.eval()
    with torch.no_grad():
        preds = model(inputs, samples, mode="predict")
        halved = model(inputs, _batch(scale=2.0)[1], mode="predict")
    assert [p["img_id"] for p in preds] == [0, 1]
    for p, h in zip(preds, halved):
        inst = p["pred_instances"]
        n = len(inst["scores"])
        assert n > 0 and inst["bboxes"].shape == (n, 4) and inst["labels"].dtype == torch.int64
        assert 0 <= int(inst["labels"].min()) and int(inst["labels"].max()) < 3
        # scale_factor 2 means the input was resized x2: boxes come back at half size in the original image.
        torch.testing.assert_close(h["pred_instances"]["bboxes"], (inst["bboxes"] / 2).clamp(max=SIZE / 2))


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, samples = _batch()
    loss, _ = model.parse_losses(model(inputs, samples, mode="loss"))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointing_the_swin_body_stages_is_bit_identical():
    plain = _build("FCOS", SWIN)
    cp = copy.deepcopy(plain)
    assert apply_activation_checkpointing(cp, ["backbone.body.layers"]) == [f"backbone.body.layers.{i}" for i in
                                                                            range(4)]
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(plain), _loss_and_grads(cp)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


def test_conv_bn_on_the_frozen_bn_resnet50_detector_within_1e5():
    plain = _build("RetinaNet", dict(model_name="resnet50", frozen_bn=True, frozen_stages=1))
    with torch.no_grad():  # non-trivial frozen statistics, so the fold is exercised
        g = torch.Generator().manual_seed(1)
        for name, buf in plain.backbone.body.named_buffers():
            if name.endswith("running_mean"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
            elif name.endswith("running_var"):
                buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
    folded = copy.deepcopy(plain)
    assert apply_efficient_conv_bn_eval(folded, ["backbone.body"]) >= 50
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(plain), _loss_and_grads(folded)
    torch.testing.assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-4)
    for n in grads_a:
        torch.testing.assert_close(grads_a[n], grads_b[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("value, error", [(0, ConfigError), (-3, ConfigError), (64.0, ConfigTypeError)])
def test_out_channels_must_be_a_positive_int(value, error):
    """Refused at construction (it failed at the first step, inside the feature pyramid)."""
    with pytest.raises(error, match=rf"^model\.out_channels={value!r} must be a positive int"):
        MODELS.build(dict(type="FCOS", backbone=dict(model_name="resnet18"), num_classes=3, out_channels=value))
