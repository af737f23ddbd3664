"""Whether a checkpoint is intact, and which checkpoint of a work dir a resume takes when the newest is not.

"Intact" is judged without reading a tensor: every file the checkpoint is made of is there and whole.
A ``torch.save`` file is a zip archive whose directory sits at its end, so a file cut short (a full
disk, a copy from a node that died) has no readable zip directory; its entries must lie inside the
file. A sharded directory needs a readable ``memfit_state.pth``, and a DCP one its ``.metadata`` (read
through memfit's safe unpickler) with every storage file it lists present and long enough; other
backends' ``.pt``/``.pth``/``.bin`` files get the file check. A byte flipped inside a tensor is not
seen here: the load itself reports what it finds.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memfit import dist
from memfit.checkpoint.dcp import METADATA_FILE, SafeFileSystemReader
from memfit.checkpoint.directory import _LEGACY_EXTRAS, EXTRAS_FILE
from memfit.checkpoint.workdir import LATEST_FILE, find_checkpoints, latest_target
from memfit.errors import CheckpointError, first_line

logger = logging.getLogger("memfit")

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy (non-zip) format starts with a pickle protocol opcode
_SHARD_SUFFIXES = (".pt", ".pth", ".bin")


def damage(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` (a file or a sharded directory) cannot be loaded, or None when
    every file it is made of is present and whole."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    return _dir_damage(path) if path.is_dir() else _file_damage(path)


def _file_damage(path: Path) -> str | None:
    size = path.stat().st_size
    if size == 0:
        return "empty: 0 bytes"
    with open(path, "rb") as f:
        head = f.read(4)
        if head != _ZIP_MAGIC:
            # The legacy format has no index to check: the load reports damage there.
            return None if head.startswith(_PICKLE_MAGIC) else f"not a torch file ({size} bytes)"
        try:
            with zipfile.ZipFile(f) as archive:
                entries = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError):
            return f"truncated or corrupt: {size} bytes and no readable zip directory"
        if not any(e.filename.endswith("data.pkl") for e in entries):
            return "not a torch file (a zip archive without data.pkl)"
        for entry in entries:  # each entry's data inside the file, behind its own header (not zeroed)
            f.seek(entry.header_offset)
            if entry.header_offset + entry.compress_size > size or f.read(4) != _ZIP_MAGIC:
                return f"truncated or overwritten: entry {entry.filename} is not whole ({size} bytes)"
    return None


def _dir_damage(path: Path) -> str | None:
    extras = next((path / n for n in (EXTRAS_FILE, *_LEGACY_EXTRAS) if (path / n).exists()), None)
    if extras is None:
        return f"{EXTRAS_FILE} is missing"
    why = _file_damage(extras)
    if why is not None:
        return f"{extras.name}: {why}"
    if (path / METADATA_FILE).exists() or any(path.glob("*.distcp")):
        return _dcp_damage(path)
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p != extras]
    if not files:
        return f"it holds only {extras.name}: its shards are missing"
    for shard in files:
        if shard.suffix in _SHARD_SUFFIXES:
            why = _file_damage(shard)
            if why is not None:
                return f"{shard.relative_to(path)}: {why}"
    return None


def _dcp_damage(path: Path) -> str | None:
    """A torch.distributed.checkpoint directory: ``.metadata`` readable, its storage files long enough."""
    if not (path / METADATA_FILE).is_file():
        return f"{METADATA_FILE} is missing"
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as exc:  # truncated: EOFError / UnpicklingError; a refused global: UnpicklingError
        return f"{METADATA_FILE} is unreadable ({first_line(exc)})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        size = shard.stat().st_size
        if size < length:
            return f"shard {name} is truncated ({size} of {length} bytes)"
    return None


@dataclass
class Choice:
    """The checkpoint a resume takes (None: there is none, the run starts from the beginning), and the
    warning to give about what was skipped on the way (None: nothing was)."""

    path: Path | None = None
    skipped: list[str] = field(default_factory=list)

    @property
    def warning(self) -> str | None:
        if not self.skipped or self.path is None:
            return None
        return f"{'; '.join(self.skipped)}: resuming from {self.path.name} instead"


def choose_checkpoint(work_dir: str | Path) -> Choice:
    """The newest intact checkpoint of ``work_dir``: the one ``last_checkpoint`` names, else the newest
    ``epoch_N``/``iter_N`` checkpoint that is intact (:func:`damage`), each skipped one recorded with why.

    No pointer and no checkpoint: ``Choice(None)``. Checkpoints or a pointer, but none intact: a
    one-line CheckpointError naming the work dir and each damaged checkpoint.
    """
    work_dir = Path(work_dir)
    target = latest_target(work_dir)
    found = find_checkpoints(target.parent if target is not None else work_dir)[::-1]  # newest first
    choice = Choice()
    candidates = found
    if target is None and found:
        choice.skipped.append(f"{work_dir / LATEST_FILE} is missing or empty")
    elif target is not None and target.exists():
        candidates = [target, *(p for p in found if p.resolve() != target.resolve())]
    elif target is not None:
        choice.skipped.append(f"{work_dir / LATEST_FILE} names {target}, which does not exist")
    for candidate in candidates:
        why = damage(candidate)
        if why is None:
            choice.path = candidate
            return choice
        choice.skipped.append(f"{candidate} is damaged ({why})")
    if choice.skipped:
        raise CheckpointError(f"{work_dir}: no intact checkpoint to resume from: {'; '.join(choice.skipped)}: "
                              "resume from another checkpoint, or delete these (and last_checkpoint) to start "
                              "from the beginning")
    return choice


def choose_named(path: str | Path) -> Choice:
    """The checkpoint for ``resume=PATH``: a work dir gives its newest intact checkpoint (as
    :func:`choose_checkpoint`); a checkpoint the user named is taken only when intact, else a
    CheckpointError lists the intact checkpoints of its folder instead of falling back to one of them."""
    from memfit.checkpoint.dcp import is_dcp_checkpoint
    from memfit.checkpoint.directory import is_directory_checkpoint
    from memfit.checkpoint.workdir import resolve_checkpoint

    path = Path(path)
    if path.is_dir() and not is_directory_checkpoint(path) and not is_dcp_checkpoint(path):
        choice = choose_checkpoint(path)
        if choice.path is None:
            resolve_checkpoint(path)  # the one-line error for a directory without a checkpoint
        elif choice.warning is None:
            logger.info(f"{path} is a work dir: using its last checkpoint {choice.path}")
        return choice
    why = damage(path)
    if why is None:
        return Choice(path)
    intact = [p.name for p in find_checkpoints(path.parent)[::-1] if p != path and damage(p) is None]
    others = (f"intact checkpoints in {path.parent}: {', '.join(intact)}" if intact
              else f"{path.parent} holds no other intact checkpoint")
    raise CheckpointError(f"cannot load checkpoint {path}: it is damaged ({why}): not resuming from it; {others}")


def agreed(decide: Callable[..., Choice], *args: object) -> Path | None:
    """Run ``decide(*args)`` on rank 0 only and give every rank its
    answer: each rank resumes from the same checkpoint even when the ranks see the files differently
    (a file system still syncing), and an error is raised on every rank alike. Rank 0 gives the warning."""
    outcome: tuple[str | None, str | None, str | None] = (None, None, None)
    if dist.is_main_process():
        try:
            choice = decide(*args)
            outcome = (str(choice.path) if choice.path is not None else None, choice.warning, None)
        except CheckpointError as exc:
            outcome = (None, None, str(exc))
    path, warning, error = dist.broadcast_object(outcome)
    if error is not None:
        raise CheckpointError(error)
    if warning is not None and dist.is_main_process():
        logger.warning(warning)
    return Path(path) if path is not None else None
