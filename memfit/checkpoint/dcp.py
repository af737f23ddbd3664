"""Read a torch.distributed.checkpoint (sharded, directory) checkpoint in one process, safely.

torch's own reader unpickles the ``.metadata`` file with plain ``pickle.load`` and non-tensor
entries with ``torch.load(weights_only=False)``, so a hostile checkpoint directory could run code.
memfit keeps its rule that loading never executes code: the metadata goes through an unpickler that
only builds DCP's metadata dataclasses and a few torch value types, and non-tensor entries load
with ``weights_only=True``. Used to consolidate (export) a sharded checkpoint without a process
group; tensor payloads are still read by torch (with ``weights_only=True`` already).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from memfit.checkpoint.io import explain_load_error, refusal
from memfit.errors import CheckpointError, first_line

METADATA_FILE = ".metadata"


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    # Every dataclass / enum DCP defines for its metadata; constructing them runs no user code.
    for module in (dcp_metadata, dcp_filesystem):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                if obj.__module__ == module.__name__:
                    allowed[(module.__name__, name)] = obj
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = getattr(torch, name)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP's ``.metadata`` that resolves only an explicit allowlist of globals."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(refusal(f"{module}.{name}")) from None


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose metadata is unpickled through an allowlist, not ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{METADATA_FILE} holds a {type(metadata)}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyBytes:
    """Load-planner mixin: non-tensor entries load with ``weights_only=True`` (torch's planners use False)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _SafeLoadPlanner(WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the saved state dict from metadata; non-tensor entries load with weights_only."""


def is_dcp_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory written by ``torch.distributed.checkpoint.save``."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def read_dcp(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Load the entries ``keys`` (top-level names, all when None) of a sharded checkpoint directory.

    Runs in one process without a process group, gathering every shard into full tensors on CPU;
    meant for export and inspection, not for resuming at scale (the strategies load shards in place).
    """
    path = _check_dir(path)
    state: dict[str, Any] = {}
    with _one_line_errors(path), warnings.catch_warnings():
        # "torch.distributed is unavailable ... assuming a single process" is exactly our intent.
        warnings.filterwarnings("ignore", message="torch.distributed is")
        _load_state_dict(
            state_dict=state,
            storage_reader=SafeFileSystemReader(path),
            planner=_SafeLoadPlanner(keys=keys),
            no_dist=True,
        )
    return state


def dcp_top_keys(path: str | Path) -> set[str]:
    """The top-level entry names of a sharded checkpoint (``state_dict``, ``optimizer``, ...)."""
    path = _check_dir(path)
    with _one_line_errors(path):
        metadata = SafeFileSystemReader(path).read_metadata()
    return {str(mapping[0]) for mapping in (metadata.planner_data or {}).values() if mapping}


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not is_dcp_checkpoint(path):
        raise CheckpointError(f"checkpoint {path} is not a sharded checkpoint directory (no {METADATA_FILE})")
    return path


@contextlib.contextmanager
def _one_line_errors(path: Path) -> Iterator[None]:
    try:
        yield
    # DCP wraps per-rank failures in CheckpointException, a BaseException subclass.
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = next(iter(exc.failures.values()))[0]
        cause = (
            str(exc) if "refuses to unpickle" in str(exc) else explain_load_error(exc, path / METADATA_FILE)
        )
        raise CheckpointError(f"cannot read sharded checkpoint {path}: {cause}") from exc


# -- sharded (DCP) checkpoints of the FSDP strategy ------------------------------------------------
def write_dcp(tensors: dict[str, Any], tmp: Path, async_group: Any = None) -> Any:
    """This rank's shards of ``tensors`` into ``tmp`` (a collective); with ``async_group`` (a process
    group on a CPU backend) staged to memory and written in the background: returns the future."""
    import torch.distributed.checkpoint as dcp

    if async_group is None:
        dcp.save(tensors, checkpoint_id=tmp)
        return None
    response = dcp.async_save(tensors, checkpoint_id=tmp, process_group=async_group)
    return getattr(response, "upload_completion", response)


def read_sharded_checkpoint(path: str | Path, with_optimizer: bool = True) -> dict:
    """A whole sharded checkpoint gathered into full tensors in this process (no process group needed).

    The result has the layout of a file checkpoint, except that ``optim_wrapper.optimizer`` is keyed
    by parameter name (``get_optimizer_state_dict``'s form); load it with :func:`fqn_optim_state`
    and ``set_optimizer_state_dict``. Used to resume at another world size with a non-FSDP strategy.
    ``with_optimizer=False`` leaves the optimizer shards unread (publishing the weights).
    """
    from memfit.checkpoint.directory import read_extras

    path = Path(path)
    state = read_extras(path)
    tensors = read_dcp(path, keys=None if with_optimizer else {"state_dict"})
    state["state_dict"] = tensors["state_dict"]
    if "optimizer" in tensors:
        state.setdefault("optim_wrapper", {})["optimizer"] = tensors["optimizer"]
    return state


def load_dcp_into(path: Path, key: str, target: dict) -> None:
    """Read entry ``key`` of the sharded checkpoint at ``path`` into ``target`` (tensors filled in
    place: each rank reads only its own shards); a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor entries load with ``weights_only=True``."""

    box = {key: target}
    try:
        dcp.load(box, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except BaseException as exc:  # DCP wraps rank failures in CheckpointException (a BaseException)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise CheckpointError(f"{path}: cannot load {key!r} from the sharded checkpoint: {first_line(exc)}") from exc
    if box[key] is not target:  # non-tensor leaves are replaced in the box, not in place
        target.update(box[key])


def fqn_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, osd: dict) -> dict:
    """An optimizer state dict keyed by parameter name; ``torch.optim``'s id-keyed form is converted
    using ``optimizer``'s parameter order (the one it was saved with when the config is the same)."""
    groups = osd.get("param_groups") or []
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return osd
    names = {id(p): n for n, p in model.named_parameters()}
    mapping: dict[Any, str] = {}
    for saved, live in zip(groups, optimizer.param_groups):
        if len(saved["params"]) != len(live["params"]):
            raise CheckpointError("optimizer state does not fit: parameter groups differ in size")
        mapping.update({i: names[id(p)] for i, p in zip(saved["params"], live["params"])})
    return {
        "state": {mapping[i]: s for i, s in osd.get("state", {}).items()},
        "param_groups": [{**g, "params": [mapping[i] for i in g["params"]]} for g in groups],
    }
