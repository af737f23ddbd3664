"""DeepSpeed checkpoint directories: recognise them, load DeepSpeed's files safely, consolidate weights.

A memfit DeepSpeed checkpoint is a directory checkpoint (:mod:`memfit.checkpoint.directory`) whose
shards are DeepSpeed's own files under the ``engine/`` tag. DeepSpeed loads them with
``torch.load(weights_only=False)``; :func:`weights_only_loads` forces ``weights_only=True`` with an
allowlist of DeepSpeed's data classes, so such a directory cannot run code either.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoint.directory import is_directory_checkpoint
from memfit.errors import CheckpointError

ENGINE_TAG = "engine"  # DeepSpeed's "tag" sub-directory inside a memfit checkpoint directory


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return is_directory_checkpoint(path) and (path / ENGINE_TAG).is_dir()


def _deepspeed_safe_globals() -> list[Any]:
    """The plain-data classes DeepSpeed pickles into its checkpoint files (enums, loss scalers, sets, and the
    (numel, start) fragment addresses of ZeRO-1/2's optimizer partitions)."""
    import collections

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, set, collections.OrderedDict, torch.Size, fragment_address]


@contextlib.contextmanager
def weights_only_loads():
    """Make DeepSpeed's own ``torch.load(weights_only=False)`` calls (engine.load_checkpoint, zero_to_fp32)
    load with ``weights_only=True`` plus an allowlist of DeepSpeed's data classes. Patching is the only
    hook: DeepSpeed hard-codes the flag."""
    original = torch.load
    allowed = _deepspeed_safe_globals()

    def safe_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(*args, **kwargs)
        except Exception as exc:
            from memfit.checkpoint.io import explain_load_error

            target = Path(str(args[0] if args else kwargs.get("f", "?")))
            cause = explain_load_error(exc, target) if target.is_file() else str(exc).splitlines()[0]
            raise CheckpointError(f"cannot load DeepSpeed checkpoint file {target}: {cause}") from None

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def read_deepspeed_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of a memfit DeepSpeed checkpoint, in one process without a
    process group (DeepSpeed's zero_to_fp32; ZeRO stage 0 checkpoints hold the full module already)."""
    path = Path(path)
    engine_dir = path / ENGINE_TAG
    if any(engine_dir.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads():
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=ENGINE_TAG))
    files = sorted(engine_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise CheckpointError(f"{path}: no DeepSpeed model states under {ENGINE_TAG}/")
    with weights_only_loads():
        module = torch.load(files[0], map_location="cpu")["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
