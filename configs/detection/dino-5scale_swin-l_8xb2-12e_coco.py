# The workload of MMDetection's large-model example (projects/example_largemodel): DINO with a Swin-L
# backbone over 5 feature scales on COCO, 8 GPUs x 2 images, 12 epochs. MMDetection's
# dino-5scale_swin-l_8xb2-12e_coco.py, with memfit's TimmBackbone in place of mmdet's SwinTransformer (same
# architecture: timm's swin_large_patch4_window12_384).
#   torchrun --nproc-per-node 8 -m memfit train configs/detection/dino-5scale_swin-l_8xb2-12e_coco.py
# Put COCO under data/coco/ (annotations/instances_{train,val}2017.json, train2017/, val2017/) and, for the
# pretrained backbone, set model.backbone.pretrained to a local timm checkpoint of the model below.
# The memory switches of the example's tables are one --cfg-options line each: see docs/detection.md.

data_root = 'data/coco/'
num_levels = 5

model = dict(
    type='DINO',
    num_queries=900,
    with_box_refine=True,
    as_two_stage=True,
    num_feature_levels=num_levels,
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                           bgr_to_rgb=False, pad_size_divisor=32),
    backbone=dict(type='TimmBackbone', model_name='swin_large_patch4_window12_384', out_indices=(0, 1, 2, 3),
                  drop_path_rate=0.2, pretrained=False),
    neck=dict(type='ChannelMapper', in_channels=[192, 384, 768, 1536], kernel_size=1, out_channels=256,
              act_cfg=None, norm_cfg=dict(type='GN', num_groups=32), num_outs=num_levels),
    encoder=dict(num_layers=6, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=256, num_levels=num_levels, dropout=0.0),
        ffn_cfg=dict(embed_dims=256, feedforward_channels=2048, ffn_drop=0.0))),
    decoder=dict(num_layers=6, return_intermediate=True, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=256, num_heads=8, dropout=0.0),
        cross_attn_cfg=dict(embed_dims=256, num_levels=num_levels, dropout=0.0),
        ffn_cfg=dict(embed_dims=256, feedforward_channels=2048, ffn_drop=0.0)), post_norm_cfg=None),
    positional_encoding=dict(num_feats=128, normalize=True, offset=0.0, temperature=20),
    bbox_head=dict(type='DINOHead', num_classes=80, sync_cls_avg_factor=True,
                   loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=1.0),
                   loss_bbox=dict(type='L1Loss', loss_weight=5.0),
                   loss_iou=dict(type='GIoULoss', loss_weight=2.0)),
    dn_cfg=dict(label_noise_scale=0.5, box_noise_scale=1.0,
                group_cfg=dict(dynamic=True, num_groups=None, num_dn_queries=100)),
    train_cfg=dict(assigner=dict(type='HungarianAssigner', match_costs=[
        dict(type='FocalLossCost', weight=2.0),
        dict(type='BBoxL1Cost', weight=5.0, box_format='xywh'),
        dict(type='IoUCost', iou_mode='giou', weight=2.0)])),
    test_cfg=dict(max_per_img=300),
)

_scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333), (640, 1333), (672, 1333), (704, 1333),
           (736, 1333), (768, 1333), (800, 1333)]
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomChoice', transforms=[
        [dict(type='RandomChoiceResize', scales=_scales, keep_ratio=True)],
        [dict(type='RandomChoiceResize', scales=[(400, 4200), (500, 4200), (600, 4200)], keep_ratio=True),
         dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600), allow_negative_crop=True),
         dict(type='RandomChoiceResize', scales=_scales, keep_ratio=True)],
    ]),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(1333, 800), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=2,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='pseudo_collate'),
    dataset=dict(type='CocoDataset', data_root=data_root, ann_file='annotations/instances_train2017.json',
                 data_prefix=dict(img='train2017/'), filter_cfg=dict(filter_empty_gt=False, min_size=32),
                 pipeline=train_pipeline),
)
val_dataloader = dict(
    batch_size=1,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='pseudo_collate'),
    dataset=dict(type='CocoDataset', data_root=data_root, ann_file='annotations/instances_val2017.json',
                 data_prefix=dict(img='val2017/'), test_mode=True, pipeline=test_pipeline),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='CocoMetric', ann_file=data_root + 'annotations/instances_val2017.json', metric='bbox',
                     format_only=False)
test_evaluator = val_evaluator

max_epochs = 12
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
val_cfg = dict()
test_cfg = dict()

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0001, weight_decay=0.0001),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=0.1)}),
)
param_scheduler = [dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[11], gamma=0.1)]
auto_scale_lr = dict(base_batch_size=16)

default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))
randomness = dict(seed=0)
