# The demo: a small ViT (4 blocks, 128 wide, 4 px patches) learns the built-in shapes dataset on CPU in a few minutes.
# `memfit train configs/vit_shapes.py` (or `make demo`). Scale up by changing model_name/img_size.

_img = 32
_classes = 4
_data = dict(type='ShapesDataset', image_size=_img, num_classes=_classes)

model = dict(
    type='TimmClassifier',
    model_name='vit_tiny_patch16_224',
    num_classes=_classes,
    img_size=_img,
    patch_size=4,
    embed_dim=128,
    depth=4,
    num_heads=4,
    class_token=False,
    global_pool='avg',
    drop_path_rate=0.0,
)

train_dataloader = dict(
    batch_size=32,
    num_workers=2,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(**_data, num_samples=8192, split='train'),
)
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(**_data, num_samples=512, split='val'),
)
val_evaluator = dict(type='Accuracy', topk=(1,))

train_cfg = dict(by_epoch=True, max_epochs=4, val_interval=1)
val_cfg = dict()

optim_wrapper = dict(
    type='AmpOptimWrapper',  # bf16 where the CPU has it natively (fp16 on CUDA); fp32 on AVX2-only CPUs
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0),
    clip_grad=dict(max_norm=5.0),
)
# Warm-up over the first 100 iterations, and a cosine over the whole run counted in epochs (stepped every
# iteration): valid for any run length (--cfg-options train_cfg.max_epochs=1), as MMDetection writes its schedules.
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='CosineAnnealingLR', by_epoch=True, convert_to_iter_based=True, eta_min=1e-5),
]

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=20),
    checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=2, save_best='accuracy/top1'),
)
randomness = dict(seed=0)
