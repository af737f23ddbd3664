"""Export the consolidated model weights of a checkpoint to ``.safetensors`` (``memfit export``), and
read any training checkpoint as one dict of full tensors (what CheckpointHook ``published_keys`` writes).

safetensors holds tensors only and cannot execute code on load, which makes it the format to hand
to inference or fine-tuning elsewhere. Works for a single-file memfit checkpoint and for a sharded
(``torch.distributed.checkpoint``) directory, gathered in one process without a process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit._version import __version__
from memfit.checkpoint.io import atomic_path, load_checkpoint
from memfit.checkpoint.weights import read_state_dict
from memfit.checkpoint.workdir import resolve_checkpoint
from memfit.errors import CheckpointError


def export_safetensors(checkpoint_path: str | Path, out_path: str | Path) -> Path:
    """Write the model weights of ``checkpoint_path`` to ``out_path`` (atomically) and return it.

    ``checkpoint_path`` may also be a work dir: its last checkpoint is exported. Tensors that share
    storage (tied weights) are cloned, because safetensors refuses aliases, and every tensor is made
    contiguous and moved to CPU. The file's metadata records the memfit and torch versions and the
    source checkpoint; the file gets the mode a checkpoint file gets (0644 under the usual umask).
    """
    from safetensors.torch import save_file

    checkpoint_path, out_path = resolve_checkpoint(checkpoint_path), Path(out_path)
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
        tmp.touch()  # created as every checkpoint file is: 0666 less the umask
        mode = tmp.stat().st_mode & 0o777
        save_file(tensors, str(tmp), metadata=metadata)  # replaces it with a file of mode 0600
        tmp.chmod(mode)
    return out_path


def read_checkpoint(path: str | Path, with_optimizer: bool = True) -> dict:
    """A training checkpoint of any form as one dict with a file checkpoint's layout and full tensors.

    A file is loaded as it is; a sharded directory (``torch.distributed.checkpoint``) is gathered in
    this process without a process group (its optimizer state keyed by parameter name); a DeepSpeed
    directory gets its weights consolidated by zero_to_fp32, but its optimizer shards cannot be
    gathered. ``with_optimizer=False`` leaves the optimizer state out of the directory forms.
    """
    from memfit.checkpoint.dcp import is_dcp_checkpoint, read_sharded_checkpoint
    from memfit.checkpoint.deepspeed import is_deepspeed_checkpoint, read_deepspeed_state_dict
    from memfit.checkpoint.directory import read_extras

    path = Path(path)
    if path.is_file():
        return load_checkpoint(path)
    if is_deepspeed_checkpoint(path):
        if with_optimizer:
            raise CheckpointError(f"{path}: a DeepSpeed checkpoint's optimizer shards cannot be gathered into one "
                                  "file: leave 'optim_wrapper' out (publish ['meta', 'state_dict'])")
        return {**read_extras(path), "state_dict": read_deepspeed_state_dict(path)}
    if is_dcp_checkpoint(path):
        return read_sharded_checkpoint(path, with_optimizer=with_optimizer)
    raise CheckpointError(f"{path}: neither a checkpoint file nor a sharded checkpoint directory")
