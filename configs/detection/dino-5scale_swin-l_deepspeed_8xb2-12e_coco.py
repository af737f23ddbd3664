# Example 2, row 6 of MMDetection's large-model example (5.0 GB per 3090 in MMDetection, but training
# diverged): DeepSpeed ZeRO-3 + AMP + checkpointing of the backbone blocks and the encoder layers.
# MMDetection ran DeepSpeed's fp16 mode, a whole-model half cast (Apex O2) that overflowed every step;
# memfit keeps precision its own axis: AmpOptimWrapper becomes DeepSpeed's torch_autocast, with fp32
# weights, losses and deformable sampling.
#   torchrun --nproc-per-node 8 -m memfit train configs/detection/dino-5scale_swin-l_deepspeed_8xb2-12e_coco.py
_base_ = './dino-5scale_swin-l_8xb2-12e_coco.py'

activation_checkpointing = dict(types=['SwinTransformerBlock'], names=['encoder.layers'])
strategy = dict(type='DeepSpeedStrategy', zero_optimization=dict(
    stage=3, overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=50000000,
    allgather_bucket_size=50000000))
optim_wrapper = dict(type='AmpOptimWrapper')
