"""Model weights from any checkpoint form, and ``load_from``: key selection, renaming, reporting.

A weights source may be a memfit checkpoint (its ``state_dict``), a plain state dict saved with
``torch.save``, a timm/torchvision-style dict under ``model``, a ``.safetensors`` file, or a
sharded checkpoint directory. ``read_state_dict`` turns each into one flat ``{key: tensor}``
dict; ``load_weights`` maps those keys onto a model and reports what did not fit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.dcp import dcp_top_keys, is_dcp_checkpoint, read_dcp
from memfit.checkpoint.io import load_checkpoint
from memfit.errors import CheckpointError

logger = logging.getLogger("memfit")

# MMEngine's default: weights saved from a DDP/DataParallel-wrapped model carry 'module.'.
DEFAULT_REVISE_KEYS: list[tuple[str, str]] = [(r"^module\.", "")]
# Where the model weights live in a checkpoint dict, in order of preference.
_MODEL_KEYS = ("state_dict", "model")

KeyMap = Mapping[str, str] | Callable[[str], "str | None"]


def read_state_dict(
    source: str | Path | Mapping[str, Any], map_location: Any = "cpu"
) -> dict[str, torch.Tensor]:
    """The model weights in ``source`` (a path or an already loaded dict) as a flat tensor dict.

    Files are read safely: ``.safetensors`` with safetensors, directories through the allowlisted
    sharded reader, anything else with ``torch.load(weights_only=True)``. From a dict, the
    ``state_dict`` or ``model`` entry is taken when present, else the dict itself.
    """
    name = str(source) if isinstance(source, str | Path) else "<state dict>"
    if isinstance(source, str | Path):
        path = Path(source)
        if path.suffix == ".safetensors" and path.is_file():
            return _read_safetensors(path, map_location)
        if is_dcp_checkpoint(path):
            # Read only the model entry of a full training checkpoint (not the optimizer state).
            wanted = set(_MODEL_KEYS) & dcp_top_keys(path)
            source = read_dcp(path, keys=wanted or None)
        else:
            source = load_checkpoint(path, map_location=map_location)
    for key in _MODEL_KEYS:
        if isinstance(source.get(key), Mapping):
            source = source[key]
            break
    state = {}
    for key, value in source.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"weights in {name}: entry {key!r} is a {type(value)}, not a tensor "
                f"(expected a state dict, or a checkpoint with one of {list(_MODEL_KEYS)})"
            )
        state[str(key)] = value
    if not state:
        raise CheckpointError(f"weights in {name}: no tensors found")
    return state


def _read_safetensors(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    device = str(map_location) if isinstance(map_location, str | torch.device) else "cpu"
    try:
        return load_file(path, device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load weights {path}: {str(exc).splitlines()[0]}") from exc


def remap_keys(
    state: Mapping[str, torch.Tensor],
    *,
    prefix: str | None = None,
    key_map: KeyMap | None = None,
    revise_keys: list[tuple[str, str]] | None = None,
    source: str = "<state dict>",
) -> dict[str, torch.Tensor]:
    """Apply ``prefix`` selection, then ``revise_keys`` regex rewrites, then ``key_map`` renames.

    ``prefix='backbone.'`` keeps only keys under it, with the prefix stripped. ``revise_keys`` is a
    list of ``(pattern, replacement)`` for ``re.sub`` (default strips a leading ``module.``).
    ``key_map`` is a callable ``key -> new key`` (None drops the key), or a dict whose entries are
    exact keys or prefixes ending in ``.`` (longest match wins): ``{'encoder.': 'backbone.'}``.
    """
    items = dict(state)
    if prefix:
        items = {k[len(prefix) :]: v for k, v in items.items() if k.startswith(prefix)}
        if not items:
            heads = sorted({k.split(".", 1)[0] + "." for k in state})
            raise CheckpointError(
                f"weights in {source}: no key starts with prefix {prefix!r}; "
                f"top-level prefixes are {heads[:10]}"
            )
    for pattern, replacement in DEFAULT_REVISE_KEYS if revise_keys is None else revise_keys:
        items = {re.sub(pattern, replacement, k): v for k, v in items.items()}
    if key_map is not None:
        rename = key_map if callable(key_map) else _dict_renamer(key_map)
        renamed = {}
        for key, value in items.items():
            new = rename(key)
            if new is not None:
                renamed[new] = value
        items = renamed
    return items


def _dict_renamer(mapping: Mapping[str, str]) -> Callable[[str], str]:
    prefixes = sorted((k for k in mapping if k.endswith(".")), key=len, reverse=True)

    def rename(key: str) -> str:
        if key in mapping:
            return mapping[key]
        for p in prefixes:
            if key.startswith(p):
                return mapping[p] + key[len(p) :]
        return key

    return rename


def load_weights(
    model: nn.Module,
    path_or_state: str | Path | Mapping[str, Any],
    *,
    strict: bool = True,
    prefix: str | None = None,
    key_map: KeyMap | None = None,
    revise_keys: list[tuple[str, str]] | None = None,
    map_location: Any = "cpu",
) -> tuple[list[str], list[str]]:
    """Load weights into ``model`` (``load_from``) and return ``(missing, unexpected)`` keys.

    Keys are selected and renamed by :func:`remap_keys`. A shape mismatch is always an error
    naming the file, the key and both shapes (drop such keys with a ``key_map`` callable returning
    None, e.g. a classifier head of another size). With ``strict=True`` missing or unexpected keys
    are an error raised before the model is touched; with ``strict=False`` they are logged on the
    'memfit' logger and returned.
    """
    source = str(path_or_state) if isinstance(path_or_state, str | Path) else "<state dict>"
    state = read_state_dict(path_or_state, map_location=map_location)
    state = remap_keys(state, prefix=prefix, key_map=key_map, revise_keys=revise_keys, source=source)

    own = model.state_dict()
    mismatched = [
        f"{k!r}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    if mismatched:
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"weights in {source} do not fit the model: shape mismatch at {mismatched[0]}{more}"
        )
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"weights in {source} do not match the model (strict=True): "
            f"{_summary('missing', missing)}; {_summary('unexpected', unexpected)}; "
            "use strict=False, prefix=, revise_keys= or key_map= to adapt"
        )
    result = model.load_state_dict(state, strict=False)
    # load_state_dict's own lists account for modules with custom _load_from_state_dict hooks.
    missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
    if missing or unexpected:
        logger.warning(
            f"load_from {source}: {_summary('missing', missing, 50)}; "
            f"{_summary('unexpected', unexpected, 50)}"
        )
    else:
        logger.info(f"load_from {source}: all {len(state)} keys loaded")
    return missing, unexpected


def _summary(label: str, keys: list[str], shown: int = 5) -> str:
    if not keys:
        return f"0 {label}"
    more = f", ... (+{len(keys) - shown})" if len(keys) > shown else ""
    return f"{len(keys)} {label} keys [{', '.join(keys[:shown])}{more}]"
