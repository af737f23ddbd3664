"""configs/detection: every config loads and validates; the seed's DINO Swin-L builds with its switches; the
detection demo config trains and evaluates end to end through the Runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit import Runner
from memfit.config import Config, parse_cfg_options, validate_config
from memfit.data import write_shapes_coco
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.registry import MODELS

CONFIGS = Path(__file__).parents[2] / "configs" / "detection"
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.py")))
def test_detection_configs_load_and_validate(name):
    validate_config(Config.fromfile(CONFIGS / name))


def test_seed_dino_swin_l_builds_with_both_checkpointing_switches():
    cfg = Config.fromfile(CONFIGS / "dino-5scale_swin-l_fsdp_8xb2-12e_coco.py")
    assert cfg.strategy["type"] == "FSDPStrategy" and cfg.optim_wrapper["type"] == "AmpOptimWrapper"
    assert cfg.optim_wrapper["clip_grad"]["max_norm"] == 0.1  # the base's settings survive the merge
    with torch.device("meta"):
        model = MODELS.build(cfg.model)
    assert 218e6 < sum(p.numel() for p in model.parameters()) < 219e6  # MMDetection's DINO Swin-L: 218M
    done = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    assert sum(n.startswith("backbone.layers.") for n in done) == 2 + 2 + 18 + 2  # every Swin block
    assert [n for n in done if n.startswith("encoder.")] == [f"encoder.layers.{i}" for i in range(6)]


def test_seed_rows_are_cfg_options_lines():
    cfg = Config.fromfile(CONFIGS / "dino-5scale_swin-l_8xb2-12e_coco.py")
    cfg.merge_from_dict(parse_cfg_options([
        "optim_wrapper.type=AmpOptimWrapper", "activation_checkpointing.types=[SwinTransformerBlock]",
        "activation_checkpointing.names=[encoder.layers]", "strategy.type=FSDPStrategy"]))
    validate_config(cfg)
    assert cfg.activation_checkpointing == dict(types=["SwinTransformerBlock"], names=["encoder.layers"])


def test_detection_demo_config_trains_and_reports_coco_map(tmp_path):
    root = tmp_path / "shapes_coco"
    for split, num in (("train", 16), ("val", 8)):
        write_shapes_coco(root, num=num, image_size=64, num_classes=4, split=split)
    cfg = Config.fromfile(CONFIGS / "fcos_r18_shapes-coco.py")
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        loader["dataset"]["data_root"] = str(root) + "/"
        loader["num_workers"] = 0
        loader.pop("persistent_workers", None)
    cfg.train_dataloader["batch_size"] = 4
    cfg.param_scheduler = [dict(type="CosineAnnealingLR", by_epoch=False, begin=0, eta_min=1e-5)]
    cfg.val_evaluator["ann_file"] = str(root / "annotations" / "instances_val.json")
    cfg.work_dir = str(tmp_path / "work")
    cfg.default_hooks["logger"]["interval"] = 1
    runner = Runner.from_cfg(cfg)
    runner.train()
    metrics = runner.val_loop.run()
    assert set(metrics) >= {f"coco/bbox_mAP{s}" for s in ("", "_50", "_75", "_s", "_m", "_l")}
    assert 0.0 <= metrics["coco/bbox_mAP"] <= 1.0
    assert (tmp_path / "work" / "best_coco_bbox_mAP_epoch_1.pth").exists()


def test_seed_backbone_lr_mult_reaches_the_backbone_parameters():
    from memfit.optim.builder import build_optim_wrapper

    cfg = Config.fromfile(CONFIGS / "dino-5scale_swin-l_8xb2-12e_coco.py")
    model = MODELS.build(dict(type="FCOS", num_classes=2, out_channels=32, backbone=dict(model_name="resnet18")))
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    names = {id(p): n for n, p in model.named_parameters()}
    lrs = {names[id(p)].split(".")[0]: g["lr"] for g in wrapper.optimizer.param_groups for p in g["params"]}
    assert lrs == {"backbone": pytest.approx(1e-5), "head": pytest.approx(1e-4)}
