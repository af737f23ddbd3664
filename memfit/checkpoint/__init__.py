"""Checkpoint storage: atomic files, safe loading, RNG state, weights loading, export, work-dir files.

The strategies and the runner call these functions; they hold no training logic. See
docs/checkpoint_and_resume.md for the file layout and the guarantees.
"""

from memfit.checkpoint.dcp import is_dcp_checkpoint, read_dcp
from memfit.checkpoint.export import export_safetensors
from memfit.checkpoint.io import atomic_path, check_plain, load_checkpoint, save_checkpoint, to_plain
from memfit.checkpoint.rng import capture_rng_state, restore_rng_state
from memfit.checkpoint.weights import load_weights, read_state_dict, remap_keys
from memfit.checkpoint.workdir import (
    LATEST_FILE,
    checkpoint_position,
    find_checkpoints,
    read_latest,
    remove_old,
    resolve_checkpoint,
    write_latest,
)

__all__ = [
    "LATEST_FILE",
    "atomic_path",
    "capture_rng_state",
    "check_plain",
    "checkpoint_position",
    "export_safetensors",
    "find_checkpoints",
    "is_dcp_checkpoint",
    "load_checkpoint",
    "load_weights",
    "read_dcp",
    "read_latest",
    "read_state_dict",
    "remap_keys",
    "remove_old",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "to_plain",
    "write_latest",
]
