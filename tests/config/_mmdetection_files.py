"""MMDetection 3's config files as it ships them (the parts memfit's tests load): its configs/_base_/default_runtime.py,
datasets/coco_detection.py and DINO's R-50 config over them (the model trimmed to what the tests need)."""

FILES = {
    "_base_/default_runtime.py": """
        default_scope = 'mmdet'
        default_hooks = dict(
            timer=dict(type='IterTimerHook'),
            logger=dict(type='LoggerHook', interval=50),
            param_scheduler=dict(type='ParamSchedulerHook'),
            checkpoint=dict(type='CheckpointHook', interval=1),
            sampler_seed=dict(type='DistSamplerSeedHook'),
            visualization=dict(type='DetVisualizationHook'))
        env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
                       dist_cfg=dict(backend='nccl'))
        vis_backends = [dict(type='LocalVisBackend')]
        visualizer = dict(type='DetLocalVisualizer', vis_backends=vis_backends, name='visualizer')
        log_processor = dict(type='LogProcessor', window_size=50, by_epoch=True)
        log_level = 'INFO'
        load_from = None
        resume = False
        """,
    "_base_/datasets/coco_detection.py": """
        dataset_type = 'CocoDataset'
        data_root = 'data/coco/'
        backend_args = None
        train_pipeline = [
            dict(type='LoadImageFromFile', backend_args=backend_args),
            dict(type='LoadAnnotations', with_bbox=True),
            dict(type='Resize', scale=(1333, 800), keep_ratio=True),
            dict(type='RandomFlip', prob=0.5),
            dict(type='PackDetInputs')
        ]
        test_pipeline = [
            dict(type='LoadImageFromFile', backend_args=backend_args),
            dict(type='Resize', scale=(1333, 800), keep_ratio=True),
            dict(type='LoadAnnotations', with_bbox=True),
            dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
        ]
        train_dataloader = dict(
            batch_size=2, num_workers=2, persistent_workers=True,
            sampler=dict(type='DefaultSampler', shuffle=True),
            batch_sampler=dict(type='AspectRatioBatchSampler'),
            dataset=dict(type=dataset_type, data_root=data_root, ann_file='annotations/instances_train2017.json',
                         data_prefix=dict(img='train2017/'), filter_cfg=dict(filter_empty_gt=True, min_size=32),
                         pipeline=train_pipeline, backend_args=backend_args))
        val_dataloader = dict(
            batch_size=1, num_workers=2, persistent_workers=True, drop_last=False,
            sampler=dict(type='DefaultSampler', shuffle=False),
            dataset=dict(type=dataset_type, data_root=data_root, ann_file='annotations/instances_val2017.json',
                         data_prefix=dict(img='val2017/'), test_mode=True, pipeline=test_pipeline,
                         backend_args=backend_args))
        test_dataloader = val_dataloader
        val_evaluator = dict(type='CocoMetric', ann_file=data_root + 'annotations/instances_val2017.json',
                             metric='bbox', format_only=False, backend_args=backend_args)
        test_evaluator = val_evaluator
        """,
    "dino/dino-4scale_r50_8xb2-12e_coco.py": """
        _base_ = ['../_base_/datasets/coco_detection.py', '../_base_/default_runtime.py']
        model = dict(type='DINO', num_queries=900, with_box_refine=True, as_two_stage=True,
                     data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                                            std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_size_divisor=1),
                     backbone=dict(type='ResNet', depth=50, num_stages=4, out_indices=(1, 2, 3)),
                     neck=dict(type='ChannelMapper', in_channels=[512, 1024, 2048], kernel_size=1, out_channels=256,
                               act_cfg=None, norm_cfg=dict(type='GN', num_groups=32), num_outs=4),
                     bbox_head=dict(type='DINOHead', num_classes=80, sync_cls_avg_factor=True))
        train_pipeline = [
            dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
            dict(type='LoadAnnotations', with_bbox=True),
            dict(type='RandomFlip', prob=0.5),
            dict(type='PackDetInputs')
        ]
        train_dataloader = dict(dataset=dict(filter_cfg=dict(filter_empty_gt=False), pipeline=train_pipeline))
        optim_wrapper = dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=0.0001, weight_decay=0.0001),
                             clip_grad=dict(max_norm=0.1, norm_type=2),
                             paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=0.1)}))
        max_epochs = 12
        train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
        val_cfg = dict(type='ValLoop')
        test_cfg = dict(type='TestLoop')
        param_scheduler = [dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[11],
                                gamma=0.1)]
        auto_scale_lr = dict(base_batch_size=16)
        """,
}
