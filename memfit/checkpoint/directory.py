"""Directory checkpoints, for every backend whose shards are written by each rank (FSDP's DCP,
DeepSpeed's engine, colossalai's booster): one atomic write, one extras file, one temp-name scheme.

A save writes into ``.<name>.tmp-<token>`` next to the target: every rank its shards (the
backend's ``write`` callback), then rank 0 the plain extras (loop position, sampler, RNG, counting)
in :data:`EXTRAS_FILE`, fsyncs, and publishes: an existing ``<name>`` is first moved aside to
``.<name>.old-<token>``, the temp directory renamed to ``<name>``, the directory fsynced, the old
copy deleted. A crash at any point leaves either the previous checkpoint or the new one readable:
:func:`recover` (called before a resume looks for checkpoints) puts an ``.old`` copy back when its
replacement never arrived, and :data:`TEMP_PATTERN` is how the cleanup recognises leftovers.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit import dist
from memfit.checkpoint.io import fsync_dir, load_checkpoint, save_checkpoint
from memfit.errors import CheckpointError

EXTRAS_FILE = "memfit_state.pth"  # the plain (non-sharded) part of a directory checkpoint
_LEGACY_EXTRAS = ("extra_state.pth",)  # written by FSDP checkpoints of memfit 0.1 before this module
# Temporary and set-aside names of directory saves and of atomic file writes (``.<name>.tmp-<pid>``).
TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]+$")


class StateRef:
    """Stands for state a backend writes and reads itself (model or optimizer shards): what a
    loaded directory checkpoint holds in place of the tensors until the strategy reads them in place."""

    def __init__(self, path: Path | None, key: str) -> None:
        self.path, self.key = path, key

    def __repr__(self) -> str:
        return f"StateRef({str(self.path) if self.path else None!r}, {self.key!r})"


def split_state(state: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, extras): the model and optimizer entries the backend writes, and everything else.

    Partial gradients of an open accumulation window (``grads``) are dropped, with a warning:
    sharded backends keep them in private buffers, so a resume from such a save restarts the window."""
    if state.get("grads"):
        logging.getLogger("memfit").warning(
            "checkpoint saved inside an accumulation window: this strategy keeps the partial gradients in "
            "its own buffers, so a resume restarts the window. Save at multiples of "
            "optim_wrapper.accumulative_counts for an exact resume")
    tensors: dict[str, Any] = {"state_dict": state["state_dict"]}
    extras = {k: v for k, v in state.items() if k not in ("state_dict", "grads")}
    wrapper = state.get("optim_wrapper")
    if isinstance(wrapper, dict) and "optimizer" in wrapper:
        tensors["optimizer"] = wrapper["optimizer"]
        extras["optim_wrapper"] = {k: v for k, v in wrapper.items() if k != "optimizer"}
    return tensors, extras


class PendingSave:
    """A directory save whose shards are still being written in the background (async DCP)."""

    def __init__(self, future: Any, tmp: Path, path: Path) -> None:
        self.future, self.tmp, self.path = future, tmp, path

    def finish(self) -> None:
        """A collective: wait for this rank's write, then (after every rank's) publish the directory."""
        self.future.result()  # re-raises a failed write
        dist.barrier()
        if dist.is_main_process():
            publish(self.tmp, self.path)
        dist.barrier()


def save_directory(path: str | Path, extras: dict, write: Callable[[Path], Any],
                   background: bool = False) -> PendingSave | None:
    """Write a directory checkpoint at ``path`` atomically; a collective (every rank calls it).

    ``write(tmp)`` writes this rank's shards into the temporary directory. ``background``: it
    returns a future instead (an async write); the extras are then written first, and the returned
    :class:`PendingSave` publishes the directory when its ``finish()`` is called.
    """
    from memfit.checkpoint.io import check_plain

    path = Path(path)
    check_plain(extras)
    tmp = path.parent / f".{path.name}.tmp-{dist.broadcast_object(secrets.token_hex(4))}"
    if dist.is_main_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if background:  # the state of this step, not of a later one
            save_checkpoint(extras, tmp / EXTRAS_FILE)
    dist.barrier()
    future = write(tmp)
    if background:
        return PendingSave(future, tmp, path)
    dist.barrier()
    if dist.is_main_process():
        save_checkpoint(extras, tmp / EXTRAS_FILE)
        publish(tmp, path)
    dist.barrier()
    return None


def publish(tmp: Path, path: Path) -> None:
    """Rank 0: rename the complete temporary directory ``tmp`` to ``path`` (replacing what is there)."""
    token = tmp.name.rsplit("-", 1)[-1]
    old = path.parent / f".{path.name}.old-{token}"
    fsync_dir(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def read_extras(path: str | Path) -> dict:
    """The plain part of a directory checkpoint (loaded with ``weights_only=True``)."""
    path = Path(path)
    for name in (EXTRAS_FILE, *_LEGACY_EXTRAS):
        if (path / name).is_file():
            return load_checkpoint(path / name)
    raise CheckpointError(f"{path}: a checkpoint directory without {EXTRAS_FILE}: not written by memfit "
                          "(or its save was interrupted)")


def is_directory_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and any((path / n).is_file() for n in (EXTRAS_FILE, *_LEGACY_EXTRAS))


def recover(work_dir: str | Path) -> list[tuple[Path, str]]:
    """Rank 0, before anything reads checkpoints: put back every ``.<name>.old-*`` whose ``<name>`` a
    crash left missing, delete the other leftovers (``.tmp-*``, superseded ``.old-*``); return each
    leftover with what was done to it ('restored' or 'removed')."""
    work_dir = Path(work_dir)
    touched: list[tuple[Path, str]] = []
    if not work_dir.is_dir():
        return touched
    for entry in sorted(work_dir.iterdir()):
        match = TEMP_PATTERN.match(entry.name)
        if not match:
            continue
        target = work_dir / match["name"]
        if match["kind"] == "old" and not target.exists():
            os.replace(entry, target)
            fsync_dir(work_dir)
            touched.append((entry, "restored"))
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        touched.append((entry, "removed"))
    return touched
