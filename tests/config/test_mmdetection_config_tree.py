"""An MMDetection config tree as MMDetection 3 ships it (its configs/_base_/default_runtime.py and
datasets/coco_detection.py, and DINO's config over them, ``{{_base_.backend_args}}`` included) loads, and a child that
swaps only the backbone and the data builds a Runner whose loader batches with AspectRatioBatchSampler, whose
visualization hook is MMDetection's and whose evaluator takes the base's arguments."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from memfit import Runner
from memfit.config import Config
from memfit.data import AspectRatioBatchSampler, build_dataloader, write_shapes_coco
from memfit.hooks.visualization import DetVisualizationHook
from tests.config._mmdetection_files import FILES

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")



def _tree(root: Path, data: Path) -> Path:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    child = root / "dino" / "shapes.py"
    child.write_text(textwrap.dedent(f"""
        _base_ = './dino-4scale_r50_8xb2-12e_coco.py'
        data_root = '{data}/'
        classes = ('circle', 'square', 'triangle')
        model = dict(num_queries=20,
                     backbone=dict(_delete_=True, type='TimmBackbone', model_name='resnet18', out_indices=(1, 2, 3)),
                     neck=dict(in_channels=[128, 256, 512]), bbox_head=dict(num_classes=3),
                     encoder=dict(num_layers=1), decoder=dict(num_layers=1))
        train_dataloader = dict(num_workers=0, dataset=dict(
            data_root=data_root, ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
            metainfo=dict(classes=classes), indices=6))
        val_dataloader = dict(num_workers=0, dataset=dict(
            data_root=data_root, ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
            metainfo=dict(classes=classes)))
        test_dataloader = val_dataloader
        val_evaluator = dict(ann_file=data_root + 'annotations/instances_train.json')
        test_evaluator = val_evaluator
        """))
    return child


def test_mmdetections_config_tree_loads_and_builds_a_runner(tmp_path):
    data = tmp_path / "shapes_coco"
    write_shapes_coco(data, num=8, image_size=32, num_classes=3, max_shapes=2, seed=1, split="train")
    cfg = Config.fromfile(_tree(tmp_path / "configs", data))
    assert cfg.train_pipeline[0].backend_args is None and cfg.test_dataloader.batch_size == 1
    assert cfg.train_dataloader.batch_sampler.type == "AspectRatioBatchSampler"
    runner = Runner.from_cfg({**cfg.to_dict(), "work_dir": str(tmp_path / "work")})
    assert any(isinstance(h, DetVisualizationHook) for h in runner._hooks)
    loader = build_dataloader(cfg.train_dataloader.to_dict(), seed=0, key="train_dataloader")
    assert isinstance(loader.batch_sampler, AspectRatioBatchSampler) and len(loader) == 3  # indices=6, batch 2
    batch = next(iter(loader))
    assert len(batch["inputs"]) == 2 and batch["inputs"][0].shape[0] == 3
