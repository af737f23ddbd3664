# The seed's Example 1, row 8 (8.5 GB per 3090 in MMDetection): FSDP + AMP + checkpointing of the Swin-L
# backbone blocks and of the deformable encoder layers, with the seed's FSDP1 wrap policy (a unit per module
# of >= 1e7 parameters: the Swin-L blocks of stages 2 and 3). Without a policy, FSDP2 shards each repeated
# block type's outermost instances (here the four Swin stages, the encoder and decoder layers). No model
# edits: checkpointing is by type and name, not `with_cp`/`num_cp`.
#   torchrun --nproc-per-node 8 -m memfit train configs/detection/dino-5scale_swin-l_fsdp_8xb2-12e_coco.py
from functools import partial

from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

_base_ = './dino-5scale_swin-l_8xb2-12e_coco.py'

activation_checkpointing = dict(types=['SwinTransformerBlock'], names=['encoder.layers'])
strategy = dict(type='FSDPStrategy',
                model_wrapper=dict(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=1e7)))
optim_wrapper = dict(type='AmpOptimWrapper')  # fp16 autocast + GradScaler on GPUs, as the seed's --amp
