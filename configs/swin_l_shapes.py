# Swin-L (197M parameters) classification at 224 px on the built-in shapes data: the planner's
# reference workload. `memfit plan configs/swin_l_shapes.py --gpu 4090 --gpus 8` predicts every plan
# for eight 24 GB GPUs; `memfit train configs/swin_l_shapes.py --auto-fit 24GiB` trains with the
# fastest that fits (on a GPU machine).

_img = 224
_classes = 4
_data = dict(type='ShapesDataset', image_size=_img, num_classes=_classes)

model = dict(
    type='TimmClassifier',
    model_name='swin_large_patch4_window7_224',
    num_classes=_classes,
    drop_path_rate=0.2,
)

train_dataloader = dict(
    batch_size=32,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(**_data, num_samples=8192, split='train'),
)
val_dataloader = dict(
    batch_size=64,
    num_workers=2,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(**_data, num_samples=512, split='val'),
)
val_evaluator = dict(type='Accuracy', topk=(1,))

train_cfg = dict(by_epoch=True, max_epochs=30, val_interval=1)
val_cfg = dict()

optim_wrapper = dict(
    type='AmpOptimWrapper',  # fp16 autocast on CUDA, as in MMEngine's and MMDetection's large-model guides
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=5.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, eta_min=1e-5),
]
strategy = dict(type='FSDPStrategy')
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=2))
randomness = dict(seed=0)
