"""The DINO Swin-L memory tables of MMDetection's large-model example that benchmarks/detection_table.py
measures: each row's switches and MMDetection's numbers, and the config a row runs (the example's config on the
shapes-coco data, with the row's switches taken from its FSDP and DeepSpeed row configs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memfit.config import Config

CONFIGS = Path(__file__).parents[1] / "configs" / "detection"
SEED_CFG = CONFIGS / "dino-5scale_swin-l_8xb2-12e_coco.py"
FSDP_CFG = CONFIGS / "dino-5scale_swin-l_fsdp_8xb2-12e_coco.py"
DS_CFG = CONFIGS / "dino-5scale_swin-l_deepspeed_8xb2-12e_coco.py"
GB = 2**30
RANKS = 2
BATCH = 2
SEED_RANKS = 8
SEED_INPUT = (1066, 800)  # (w, h): a 4:3 COCO image at MMDetection's largest training scale (800, 1333)
# MMDetection's FSDP units (its name_auto_wrap_policy: SwinBlock, DeformableDetrTransformerEncoderLayer).
FSDP_UNITS = ["SwinTransformerBlock", "DeformableEncoderLayer"]


@dataclass(frozen=True)
class Row:
    """A row of MMDetection's tables: its switches and the example's peak (GB), iteration time (s) and GPU."""

    id: str
    amp: bool
    gc_backbone: bool
    gc_encoder: bool
    shard: str  # '' | 'fsdp' | 'deepspeed'
    seed_gb: float
    seed_s: float
    seed_gpu: str = "3090"


# Example 1 (FSDP) rows 1-8; Example 2 (DeepSpeed) rows 1, 2, 3, 5 are Example 1's rows 1, 2, 4, 6.
ROWS = [
    Row("1", False, False, False, "", 49, 0.9, "A100-80"),
    Row("2", True, False, False, "", 39, 1.2, "A100-80"),
    Row("3", False, True, False, "", 33, 1.1, "A100-80"),
    Row("4", True, True, False, "", 25, 1.3, "A100-80"),
    Row("5", False, True, True, "", 18, 2.2),
    Row("6", True, True, True, "", 13, 1.6),
    Row("7", False, True, True, "fsdp", 14, 2.9),
    Row("8", True, True, True, "fsdp", 8.5, 2.4),
    Row("ds4", True, True, False, "deepspeed", 10.5, 1.5),
    Row("ds6", True, True, True, "deepspeed", 5.0, 1.4),
]
BY_ID = {r.id: r for r in ROWS}
# Example 2's table: (its ID, the row measured for it, MMDetection's GB and seconds in Example 2).
EXAMPLE2 = [("1", "1", 49, 0.9), ("2", "2", 39, 1.2), ("3", "4", 25, 1.3), ("4", "ds4", 10.5, 1.5),
            ("5", "6", 13, 1.6), ("6", "ds6", 5.0, 1.4)]


def base_config(data_root: Path, resize: tuple[int, int] | None = None) -> dict:
    """MMDetection's DINO Swin-L config with its COCO data swapped for the shapes-coco dataset under ``data_root``
    (``resize``: (w, h) every image is resized to)."""
    cfg = Config.fromfile(SEED_CFG).to_dict()
    pipeline = [dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True)]
    if resize:
        pipeline.append(dict(type="Resize", scale=resize, keep_ratio=False))
    loader = cfg["train_dataloader"]
    loader.update(num_workers=0, persistent_workers=False, sampler=dict(type="DefaultSampler", shuffle=False))
    loader["dataset"].update(data_root=f"{data_root}/", ann_file="annotations/instances_train.json",
                             data_prefix=dict(img="train/"), pipeline=[*pipeline, dict(type="PackDetInputs")])
    for key in ("val_dataloader", "test_dataloader", "val_evaluator", "test_evaluator", "val_cfg", "test_cfg"):
        cfg.pop(key, None)
    cfg["work_dir"] = str(data_root / "work")
    return cfg


def row_config(base: dict, row: Row) -> dict:
    """``base`` with the row's switches, taken from MMDetection's FSDP and DeepSpeed row configs."""
    fsdp, ds = Config.fromfile(FSDP_CFG).to_dict(), Config.fromfile(DS_CFG).to_dict()
    gc = fsdp["activation_checkpointing"]  # dict(types=['SwinTransformerBlock'], names=['encoder.layers'])
    cfg = {**base, "optim_wrapper": dict(base["optim_wrapper"])}
    if row.amp:
        cfg["optim_wrapper"].update(type="AmpOptimWrapper", dtype="bfloat16")
    spec = {**({"types": gc["types"]} if row.gc_backbone else {}), **({"names": gc["names"]} if row.gc_encoder else {})}
    if spec:
        cfg["activation_checkpointing"] = spec
    if row.shard == "fsdp":
        # The units that gave MMDetection's numbers. wrap_modules takes precedence over the row config's
        # size-based policy (MMEngine's example), which makes stage 3's 18 Swin blocks one unit.
        cfg["strategy"] = {**fsdp["strategy"], "wrap_modules": FSDP_UNITS}
    elif row.shard:
        cfg["strategy"] = ds["strategy"]
    return cfg
