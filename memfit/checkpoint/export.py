"""Export the consolidated model weights of a checkpoint to ``.safetensors`` (``memfit export``).

safetensors holds tensors only and cannot execute code on load, which makes it the format to hand
to inference or fine-tuning elsewhere. Works for a single-file memfit checkpoint and for a sharded
(``torch.distributed.checkpoint``) directory, gathered in one process without a process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit._version import __version__
from memfit.checkpoint.io import atomic_path
from memfit.checkpoint.weights import read_state_dict


def export_safetensors(checkpoint_path: str | Path, out_path: str | Path) -> Path:
    """Write the model weights of ``checkpoint_path`` to ``out_path`` (atomically) and return it.

    Tensors that share storage (tied weights) are cloned, because safetensors refuses aliases, and
    every tensor is made contiguous and moved to CPU. The file's metadata records the memfit and
    torch versions and the source checkpoint.
    """
    from safetensors.torch import save_file

    checkpoint_path, out_path = Path(checkpoint_path), Path(out_path)
    from memfit.checkpoint.deepspeed import is_deepspeed_checkpoint, read_deepspeed_state_dict

    # A DeepSpeed checkpoint directory is consolidated by DeepSpeed's zero_to_fp32.
    deepspeed = is_deepspeed_checkpoint(checkpoint_path)
    state = read_deepspeed_state_dict(checkpoint_path) if deepspeed else read_state_dict(checkpoint_path)
    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if ptr is not None and ptr in seen_storages:
            tensor = tensor.clone()
        elif ptr is not None:
            seen_storages.add(ptr)
        tensors[key] = tensor.contiguous()
    metadata = {
        "format": "pt",
        "memfit_version": __version__,
        "torch_version": torch.__version__,
        "source": str(checkpoint_path.resolve()),
    }
    with atomic_path(out_path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return out_path
