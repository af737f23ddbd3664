"""Atomic checkpoint files: plain-data validation, temp-file + fsync + rename writes, safe loading.

A memfit checkpoint is one ``torch.save`` file holding tensors and plain Python data only, so that
``torch.load(weights_only=True)`` can read it back without unpickling any object. Writes go to a
hidden temporary file in the same directory, are flushed to disk, then renamed over the final name
(``os.replace`` is atomic on POSIX), and the directory entry is flushed too: a crash or ``kill -9``
at any moment leaves either the old file or the new complete one under the final name, never a
partial file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import os
import re
import types
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import CheckpointError, first_line

# Exact types (not isinstance): numpy.float64 subclasses float and a namedtuple subclasses tuple,
# but both pickle as a global that weights_only refuses, so they must be caught before writing.
_SCALARS = (int, float, bool, str, bytes, type(None))
_SEQUENCES = (list, tuple, torch.Size)
_MAPPINGS = (dict, OrderedDict)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def to_plain(obj: Any) -> Any:
    """Convert a config-like value into data a ``weights_only`` load accepts (for the meta).

    Classes and functions become ``'module:qualname'`` strings (the form the registry resolves),
    tuples and sets become lists, numpy scalars become Python numbers and numpy arrays tensors,
    ``torch.dtype``/``torch.device``/paths become strings, dataclasses become dicts, and anything
    else becomes its ``repr``. Tensors and plain scalars are returned unchanged.
    """
    if type(obj) in _SCALARS or type(obj) in _TENSORS:
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, enum.Enum):
        return repr(obj)
    for base in (bool, int, float, str):
        if isinstance(obj, base):  # a subclass of a plain type pickles as its class: store the base
            return base(obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, torch.Tensor):
        # A tensor subclass (e.g. a DTensor) pickles as its class: store a plain tensor.
        return obj.detach().as_subclass(torch.Tensor)
    if isinstance(obj, dict):
        return {_plain_key(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, set | frozenset):
        items = [to_plain(v) for v in obj]
        with contextlib.suppress(TypeError):
            items.sort()
        return items
    if isinstance(obj, type | types.FunctionType | types.BuiltinFunctionType | types.MethodType):
        return f"{obj.__module__}:{obj.__qualname__}"
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return repr(obj)


def _plain_key(key: Any) -> str | int:
    return key if type(key) in (str, int) else str(to_plain(key))


def check_plain(state: Any, path: str = "") -> None:
    """Raise CheckpointError naming the first value in ``state`` that is not a tensor or plain data.

    Done before writing so a bad value is reported by its key path (``'meta.cfg.model.type'``) at
    save time, instead of producing a file that ``weights_only`` loading refuses at resume time.
    """
    kind = type(state)
    if kind in _SCALARS or kind in _TENSORS:
        return
    where = path or "<root>"
    if isinstance(state, torch.Tensor):
        raise CheckpointError(
            f"checkpoint value at {where!r} is a {kind} tensor subclass: store a plain tensor "
            "(gather it to a full tensor, or use the sharded checkpoint format)"
        )
    if kind in _MAPPINGS:
        for key, value in state.items():
            sub = f"{path}.{key}" if path else str(key)
            if type(key) not in (str, int):
                raise CheckpointError(
                    f"checkpoint key {sub!r} is a {type(key)}: use str or int keys "
                    "(memfit.checkpoint.to_plain converts them)"
                )
            check_plain(value, sub)
        return
    if kind in _SEQUENCES:
        for i, value in enumerate(state):
            check_plain(value, f"{path}[{i}]" if path else f"[{i}]")
        return
    raise CheckpointError(
        f"checkpoint value at {where!r} is a {kind}: store plain data "
        "(tensors, dict, list, str, int, float, bool, None; memfit.checkpoint.to_plain converts it)"
    )


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and rename it onto ``path``.

    The temporary name is ``.<name>.tmp-<pid>`` in the same directory (a rename is only atomic
    within one file system). On an exception the temporary file is removed and ``path`` is left
    untouched. Writers that accept a path but not a file object (safetensors) use this directly.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; some file systems (and Windows) cannot open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(state: dict, path: str | Path) -> None:
    """Write ``state`` (tensors and plain data only) to ``path`` atomically.

    The state is validated first (CheckpointError names the offending key path), then written to
    ``.<name>.tmp-<pid>`` in the same directory, flushed and fsynced, renamed onto ``path`` and the
    directory fsynced. Readers therefore see either the previous file or the complete new one.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"save_checkpoint expects a dict, got {type(state)} for {path}")
    check_plain(state)
    # atomic_path fsyncs the closed temp file before the rename.
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as exc:  # a full disk is OSError, or RuntimeError from torch's zip writer
        raise write_error(path, exc) from exc


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small text file with the same temp + fsync + rename protocol (pointer files)."""
    try:
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write(text)
    except OSError as exc:
        raise write_error(path, exc) from exc


def write_error(path: str | Path, exc: BaseException) -> CheckpointError:
    """One line for a failed write: the file, the cause (no space, no permission, a directory of that name)
    and what to do; the atomic protocol left the previous file of that name, and every other checkpoint,
    as it was."""
    if isinstance(exc, IsADirectoryError | NotADirectoryError) or getattr(exc, "errno", None) == errno.ENOTEMPTY:
        kind = "a directory" if Path(path).is_dir() else "a file"
        return CheckpointError(f"cannot write {path}: {kind} of that name is in the way, a checkpoint of another run "
                               "in the other format: continue that run with its own strategy, set work_dir to "
                               "another folder, or remove it (earlier checkpoints are untouched)")
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
    return CheckpointError(f"cannot write {path}: {cause}: free disk space or set work_dir to another folder "
                           "(earlier checkpoints are untouched)")


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict:
    """Load a memfit checkpoint with ``torch.load(weights_only=True)``; never executes code.

    A missing file, a directory, a truncated or corrupt file, and a file whose pickle names an
    object outside torch's weights-only allowlist each raise a one-line CheckpointError naming the
    file and the cause. There is deliberately no fallback to ``weights_only=False``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a directory, not a checkpoint file "
            "(a sharded checkpoint is read with memfit.checkpoint.read_dcp)"
        )
    try:
        with warnings.catch_warnings():
            # A raw pickle of another protocol triggers a torch warning before the refusal we report.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, ... here
        state = _load_mmengine(path, map_location)
        if state is None:
            raise CheckpointError(f"cannot load checkpoint {path}: {explain_load_error(exc, path)}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict: not a memfit checkpoint "
                              "or state dict; save weights with torch.save(model.state_dict(), path)")
    return state


def _load_mmengine(path: Path, map_location: Any) -> Any:
    """An MMEngine checkpoint, its own objects read as inert placeholders. None when the file is not
    one; a CheckpointError naming the first other global when it holds one (never loaded)."""
    from memfit.checkpoint.mmengine import OPENMMLAB_PREFIXES, is_foreign, load_with_placeholders, unsafe_globals

    names = unsafe_globals(path)
    others = [n for n in names if not is_foreign(n)]
    if not any(n.startswith(OPENMMLAB_PREFIXES) for n in names):
        return None
    if others:
        raise CheckpointError(f"cannot load checkpoint {path}: {refusal(others[0])}")
    try:
        return load_with_placeholders(path, names, map_location)
    except Exception:
        return None


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
# os.system pickles as posix.system (or nt.system); report the name the user knows.
_OS_ALIASES = {"posix.": "os.", "nt.": "os."}


def refusal(global_name: str) -> str:
    """The one-line cause for a pickle that names ``global_name`` (a callable or class) to load."""
    for alias, real in _OS_ALIASES.items():
        if global_name.startswith(alias):
            global_name = real + global_name[len(alias) :]
    return (
        f"weights_only loading refuses to unpickle object {global_name!r} — memfit never executes code "
        "from a checkpoint; re-save it as tensors and plain data (memfit.checkpoint.to_plain)"
    )


def explain_load_error(exc: BaseException, path: Path) -> str:
    """Turn torch.load's multi-paragraph exception into a one-line cause."""
    msg = str(exc)
    match = _GLOBAL_RE.search(msg)
    if match:
        return refusal(match.group(1))
    first_line = msg.splitlines()[0][:160] if msg else type(exc).__name__
    if isinstance(exc, EOFError) or path.stat().st_size == 0:
        return "the file is empty or truncated (an interrupted copy or save?)"
    if _starts_with_zip_magic(path):
        return f"the file is truncated or corrupt ({first_line})"
    # Not a zip archive: either torch's legacy format damaged, or not a torch file at all.
    return f"not a torch checkpoint (no zip archive and no readable tensor pickle: {type(exc).__name__})"


def _starts_with_zip_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


__all__ = [
    "atomic_path",
    "check_plain",
    "explain_load_error",
    "load_checkpoint",
    "refusal",
    "save_checkpoint",
    "to_plain",
    "write_text_atomic",
]
