"""DINO: losses, predictions, config errors, checkpointing switches, AMP, a short overfit and the fake-tensor step.

A tiny model (Swin with embed_dim 32 and one block per stage, embed_dims 32, 2 + 2 layers, 30 queries) on
64 px ShapesDataset images keeps each test well under a few seconds on one CPU thread.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import memfit.model.detection  # noqa: F401  (registers TimmBackbone)
import memfit.model.detection.dino.matcher as matcher_module
import memfit.model.detection.necks  # noqa: F401  (registers ChannelMapper)
from memfit.config import Config
from memfit.data import ShapesDataset
from memfit.errors import ConfigError
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.memory.wrapping import wrapped_forward
from memfit.model.detection.dino import DINO
from memfit.optim import OptimWrapper
from memfit.registry import MODELS

E = 32  # embed_dims
PREPROCESSOR = dict(type="DetDataPreprocessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                    bgr_to_rgb=False, pad_size_divisor=32)


FIXTURE = Path(__file__).parents[1] / "fixtures" / "detection" / "dino_tiny.py"


def tiny_cfg(dropout: float = 0.0, drop_path: float = 0.0, **over) -> dict:
    """The shared tiny DINO (tests/fixtures/detection/dino_tiny.py) with 30 queries and the given dropouts."""
    cfg = copy.deepcopy(Config.fromfile(FIXTURE).to_dict()["model"])
    cfg["num_queries"] = 30
    cfg["backbone"]["drop_path_rate"] = drop_path
    for part in ("encoder", "decoder"):
        layer = cfg[part]["layer_cfg"]
        for attn in ("self_attn_cfg", "cross_attn_cfg"):
            if attn in layer:
                layer[attn] = {**layer[attn], "dropout": dropout}
        layer["ffn_cfg"] = {**layer["ffn_cfg"], "ffn_drop": dropout}
    cfg.update(over)
    return cfg


def build(seed: int = 0, **kw) -> DINO:
    torch.manual_seed(seed)
    return MODELS.build(tiny_cfg(**kw), key="model")


def shapes_batch(n: int = 2, pad_second: bool = False) -> tuple[torch.Tensor, list[dict]]:
    """``n`` ShapesDataset images with MMDetection's fields through DetDataPreprocessor (normalised, padded);
    ``pad_second``: the second image is cropped to 40 px wide, so the batch pads it to 64 (boxes clipped)."""
    ds = ShapesDataset(num_samples=n, image_size=64, max_shapes=3, transform=[])
    images, samples = [], []
    for i in range(n):
        item = ds[i]
        img, boxes = item["img"], item["boxes"]
        if pad_second and i == 1:
            img, boxes = img[:, :, :40], boxes.clone()
            boxes[:, 0::2] = boxes[:, 0::2].clamp(max=39)
        shape = tuple(img.shape[-2:])
        images.append(img)
        samples.append(dict(img_id=i, img_shape=shape, ori_shape=(shape[0] * 2, shape[1] * 2), scale_factor=(0.5, 0.5),
                            gt_instances=dict(bboxes=boxes, labels=item["labels"])))
    batch = MODELS.build(PREPROCESSOR)(dict(inputs=images, data_samples=samples))
    return batch["inputs"], batch["data_samples"]


def loss_keys(layers: int = 2) -> set[str]:
    keys = {f"{p}{k}loss_{t}" for p in ["", *(f"d{i}." for i in range(layers - 1))] for k in ("", "dn_")
            for t in ("cls", "bbox", "iou")}
    return keys | {f"enc_loss_{t}" for t in ("cls", "bbox", "iou")}


def test_loss_dict_keys_and_finite_values_with_a_padded_image():
    model = build()
    x, samples = shapes_batch(pad_second=True)
    losses = model(x, samples, mode="loss")
    assert set(losses) == loss_keys(2)  # MMDetection's DINOHead keys: last layer, d0., enc_, dn_
    for k, v in losses.items():
        assert v.dim() == 0 and torch.isfinite(v) and v.item() > 0, k
    loss, _ = model.parse_losses(losses)
    loss.backward()
    # timm Swin's final norm is not on the stage-feature path (the backbone's business, not DINO's)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and not n.startswith("backbone.norm.")}
    # every other parameter takes part: backbone, neck, both stacks, the encoder's branch, the CDN label embedding
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert grads["dn_query_generator.label_embedding.weight"].abs().sum() > 0


def test_predict_boxes_in_original_pixels_from_the_tensor_outputs():
    model = build().eval()
    x, samples = shapes_batch(pad_second=True)
    with torch.no_grad():
        all_cls, all_boxes = model(x, samples, mode="tensor")
        preds = model(x, samples, mode="predict")
    assert all_cls.shape == (2, 2, 30, 4) and all_boxes.shape == (2, 2, 30, 4)  # [layers, B, queries, ...]
    cls, boxes = all_cls[-1], all_boxes[-1]
    for i, (pred, sample) in enumerate(zip(preds, samples)):
        inst = pred["pred_instances"]
        assert pred["img_id"] == i and pred["ori_shape"] == sample["ori_shape"]
        assert inst["bboxes"].shape == (20, 4) and inst["labels"].dtype == torch.int64
        assert torch.equal(inst["scores"], inst["scores"].sort(descending=True).values)
        # the top-scoring (query, class) pair, decoded by hand: cxcywh in [0, 1] -> img_shape pixels -> / 0.5
        q, c = divmod(int(cls[i].sigmoid().flatten().argmax()), 4)
        (h, w), (h0, w0) = sample["img_shape"], sample["ori_shape"]
        cx, cy, bw, bh = boxes[i, q].tolist()
        xyxy = torch.tensor([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h])
        xyxy = torch.stack([xyxy[0].clamp(0, w), xyxy[1].clamp(0, h), xyxy[2].clamp(0, w), xyxy[3].clamp(0, h)]) / 0.5
        assert int(inst["labels"][0]) == c
        torch.testing.assert_close(inst["bboxes"][0], xyxy)
        assert inst["bboxes"][:, 0::2].max() <= w0 and inst["bboxes"][:, 1::2].max() <= h0


@pytest.mark.parametrize(("over", "message"), [
    (dict(num_querys=30), "unknown key 'num_querys': did you mean 'num_queries'"),
    (dict(encoder=dict(num_layers=2, layer_cfg=dict(self_attn_cfg=dict(embed_dims=E, num_level=4)))),
     "model.encoder.layer_cfg.self_attn_cfg: unknown key 'num_level': did you mean 'num_levels'"),
    (dict(bbox_head=dict(type="DINOHead", num_classes=4, loss_cls=dict(type="CrossEntropyLoss"))),
     "model.bbox_head.loss_cls.type='CrossEntropyLoss' is not supported: use 'FocalLoss'"),
    (dict(bbox_head=dict(type="DETRHead", num_classes=4)), "model.bbox_head.type='DETRHead' is not supported"),
    (dict(num_feature_levels=5), "numbers of feature levels differ"),
    (dict(with_box_refine=False), "with_box_refine=True and as_two_stage=True"),
    (dict(dn_cfg=dict(group_cfg=dict(dynamic=True, num_dn_queri=5))), "did you mean 'num_dn_queries'"),
    (dict(train_cfg=dict(assigner=dict(type="HungarianAssigner", match_costs=[dict(type="ClassificationCost")]))),
     "match_costs[0].type='ClassificationCost' is not supported"),
])
def test_config_errors_name_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        MODELS.build(tiny_cfg(**over), key="model")
    assert message in str(err.value) and "\n" not in str(err.value)


def _loss_and_grads(model: DINO, x: torch.Tensor, samples: list[dict], seed: int = 123) -> tuple[dict, dict]:
    torch.manual_seed(seed)  # dropout, drop-path and the denoising noise draw the same numbers
    losses = model(x, samples, mode="loss")
    model.parse_losses(losses)[0].backward()
    return ({k: v.detach() for k, v in losses.items()},
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def test_checkpointing_backbone_stages_and_encoder_layers_is_bit_identical():
    """GC of Backbone (Swin's stages) and GC of Encoder (encoder.layers.<i>) are separate switches; with
    dropout and drop-path on, the recomputation replays the same random numbers, so nothing changes."""
    plain = build(dropout=0.1, drop_path=0.1)
    x, samples = shapes_batch(pad_second=True)
    ref_losses, ref_grads = _loss_and_grads(plain, x, samples)
    plain.zero_grad(set_to_none=True)
    other_seed, _ = _loss_and_grads(plain, x, samples, seed=7)
    assert not torch.equal(other_seed["enc_loss_cls"], ref_losses["enc_loss_cls"])  # the randomness is live
    for names in (["backbone.layers.0", "backbone.layers.1", "backbone.layers.2", "backbone.layers.3"],
                  ["encoder.layers.0", "encoder.layers.1"]):
        model = copy.deepcopy(plain)
        model.zero_grad(set_to_none=True)
        assert apply_activation_checkpointing(model, names) == names
        losses, grads = _loss_and_grads(model, x, samples)
        assert all(torch.equal(losses[k], ref_losses[k]) for k in ref_losses), names
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads), names
    # by type, and MMDetection's encoder.num_cp switch, wrap the same modules
    by_type = copy.deepcopy(plain)
    assert apply_activation_checkpointing(by_type, dict(types=["DeformableEncoderLayer"])) == [
        "encoder.layers.0", "encoder.layers.1"]
    num_cp = build(encoder=dict(num_layers=2, num_cp=1, layer_cfg=tiny_cfg()["encoder"]["layer_cfg"]))
    assert wrapped_forward(num_cp.encoder.layers[0]) is not None and wrapped_forward(num_cp.encoder.layers[1]) is None


def test_bf16_autocast_trains_close_to_fp32_with_fp32_islands(monkeypatch):
    model = build()
    x, samples = shapes_batch()
    seen = []
    grid_sample = torch.nn.functional.grid_sample

    def spy(value, grid, *args, **kwargs):
        seen.append((value.dtype, grid.dtype))
        return grid_sample(value, grid, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grid_sample", spy)
    torch.manual_seed(1)
    fp32 = model.parse_losses(model(x, samples, mode="loss"))[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        losses = model(x, samples, mode="loss")
        assert model.encoder.layers[0].ffn.layers[0][0](torch.zeros(1, E)).dtype == torch.bfloat16  # autocast is on
        bf16 = model.parse_losses(losses)[0]
    assert all(v.dtype == torch.float32 for v in losses.values())  # matcher and losses are fp32 islands
    assert seen and set(seen) == {(torch.float32, torch.float32)}  # deformable sampling in fp32 under bf16
    assert abs(bf16.item() - fp32.item()) / fp32.item() < 0.02, (bf16.item(), fp32.item())  # measured 0.15%
    bf16.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_short_overfit_reduces_the_loss():
    """30 AdamW steps on 2 fixed images: the total loss drops clearly (measured: 22.9 -> 9.1, x0.42)."""
    model = build()
    x, samples = shapes_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    torch.manual_seed(0)
    history = []
    for _ in range(30):
        loss = model.parse_losses(model(x, samples, mode="loss"))[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last < 0.5 * first, history


def test_train_step_runs_on_fake_tensors_with_the_stand_in_matching(monkeypatch):
    """The planner's step: a meta-built model made fake, a fake batch, loss + backward + AdamW step.
    No host sync: scipy is never called (the matcher pairs query i with target i)."""
    monkeypatch.setattr(matcher_module, "linear_sum_assignment",
                        lambda cost: pytest.fail("the matcher must not run scipy on fake tensors"))
    with torch.device("meta"):
        model = MODELS.build(tiny_cfg(), key="model")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-4))
        samples = [dict(img_id=i, img_shape=(64, 64 - 16 * i), ori_shape=(64, 64), scale_factor=(1.0, 1.0),
                        gt_instances=dict(bboxes=torch.tensor([[4.0, 4.0, 30.0, 30.0]]).repeat(i + 2, 1),
                                          labels=torch.zeros(i + 2, dtype=torch.long))) for i in range(2)]
        log_vars = model.train_step(dict(inputs=torch.randn(2, 3, 64, 64), data_samples=samples), wrapper)
    assert set(log_vars) == loss_keys(2) | {"loss"}
    assert isinstance(log_vars["loss"], FakeTensor)
    assert all(isinstance(p, FakeTensor) for p in model.parameters())


@pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
def test_runner_trains_and_evaluates_dino_on_shapes_coco(tmp_path):
    """End to end through MMDetection's config language: CocoDataset + pipelines, DetDataPreprocessor, DINO,
    CocoMetric (the val pipeline resizes 64 -> 96 px, so predictions go back through scale_factor).

    The runner trains: 8 AdamW steps on one fixed batch of 4 images (no flip) lower the loss (measured 24.7 ->
    17.6-18.7 over the last three, x0.74; asserted x0.85). Too few steps for a mAP above 0 (DINO needs hundreds),
    so the metric is checked for its keys and range only; tests/evaluator checks its numbers."""
    from memfit import Runner
    from memfit.config import Config
    from memfit.data import write_shapes_coco
    from memfit.hooks import Hook

    root = tmp_path / "shapes_coco"
    for split, num in (("train", 4), ("val", 4)):
        write_shapes_coco(root, num=num, image_size=64, num_classes=4, split=split)
    cfg = Config.fromfile(Path(__file__).parents[2] / "configs" / "detection" / "fcos_r18_shapes-coco.py")
    cfg.model = tiny_cfg()
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader["dataset"]["data_root"] = str(root) + "/"
        loader["num_workers"] = 0
        loader.pop("persistent_workers", None)
    cfg.train_dataloader["batch_size"] = 4
    train_set = cfg.train_dataloader["dataset"]
    train_set["pipeline"] = [t for t in train_set["pipeline"] if t["type"] != "RandomFlip"]
    cfg.train_cfg = dict(by_epoch=True, max_epochs=8, val_interval=8)
    cfg.default_hooks["checkpoint"] = dict(type="CheckpointHook", interval=8)
    cfg.param_scheduler = []
    cfg.val_evaluator["ann_file"] = str(root / "annotations" / "instances_val.json")
    cfg.work_dir = str(tmp_path / "work")
    losses = []

    class RecordLoss(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            losses.append(float(outputs["loss"]))

    cfg.custom_hooks = [RecordLoss()]
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.85 * losses[0], losses
    metrics = runner.val_loop.run()
    assert set(metrics) >= {f"coco/bbox_mAP{s}" for s in ("", "_50", "_75")}
    assert 0.0 <= metrics["coco/bbox_mAP"] <= 1.0
