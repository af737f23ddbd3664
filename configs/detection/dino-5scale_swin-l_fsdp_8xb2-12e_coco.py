# Example 1, row 8 of MMDetection's large-model example (8.5 GB per 3090 in MMDetection): FSDP + AMP +
# checkpointing of the Swin-L backbone blocks and of the deformable encoder layers. As MMDetection's
# project, each Swin block and each encoder layer is an FSDP unit (without `wrap_modules`, FSDP2 would
# shard the outermost repeated blocks: the four Swin stages and the encoder/decoder layers). No model
# edits: checkpointing is by type and name, not `with_cp`/`num_cp`.
#   torchrun --nproc-per-node 8 -m memfit train configs/detection/dino-5scale_swin-l_fsdp_8xb2-12e_coco.py
_base_ = './dino-5scale_swin-l_8xb2-12e_coco.py'

activation_checkpointing = dict(types=['SwinTransformerBlock'], names=['encoder.layers'])
strategy = dict(type='FSDPStrategy', wrap_modules=['SwinTransformerBlock', 'DeformableEncoderLayer'])
optim_wrapper = dict(type='AmpOptimWrapper')  # fp16 autocast + GradScaler on GPUs, as MMDetection's --amp
