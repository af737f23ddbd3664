# The detection demo: FCOS (torchvision) on a timm ResNet-18 + FPN learns the built-in shapes, written as a
# COCO-format dataset, on a laptop CPU in a few minutes, to a COCO box mAP above 0.5.
#   memfit data shapes-coco --out data/shapes_coco --image-size 96 --num 2400
#   memfit train configs/detection/fcos_r18_shapes-coco.py           (or both: `make demo-detection`)
# Every piece is MMDetection's config language: CocoDataset, its pipeline names, DetDataPreprocessor, CocoMetric.

data_root = 'data/shapes_coco/'
classes = ('circle', 'square', 'triangle', 'cross')
_img = 96

model = dict(
    type='FCOS',
    num_classes=len(classes),
    backbone=dict(type='TimmBackbone', model_name='resnet18'),
    out_channels=64,
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[127.5] * 3, std=[127.5] * 3, pad_size_divisor=32),
)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(_img, _img), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=8,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='pseudo_collate'),
    dataset=dict(type='CocoDataset', data_root=data_root, ann_file='annotations/instances_train.json',
                 data_prefix=dict(img='train/'), metainfo=dict(classes=classes),
                 filter_cfg=dict(filter_empty_gt=True, min_size=8), pipeline=train_pipeline),
)
val_dataloader = dict(
    batch_size=16,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='pseudo_collate'),
    dataset=dict(type='CocoDataset', data_root=data_root, ann_file='annotations/instances_val.json',
                 data_prefix=dict(img='val/'), metainfo=dict(classes=classes), test_mode=True,
                 pipeline=test_pipeline),
)
val_evaluator = dict(type='CocoMetric', ann_file=data_root + 'annotations/instances_val.json', metric='bbox')

train_cfg = dict(by_epoch=True, max_epochs=1, val_interval=1)
val_cfg = dict()

optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=2e-3, weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=10.0),
)
param_scheduler = [  # warm-up by iterations, the cosine over the whole run: valid for any run length
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(type='CosineAnnealingLR', by_epoch=True, convert_to_iter_based=True, eta_min=2e-5),
]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=20),
    checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=1, save_best='coco/bbox_mAP'),
)
randomness = dict(seed=0)
