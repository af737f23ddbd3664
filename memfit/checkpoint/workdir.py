"""The checkpoints of a work dir: the ``last_checkpoint`` pointer, listing by position, pruning, and
which checkpoint a path given by the user (a file, a sharded directory or a work dir) stands for.

Checkpoints are named ``epoch_{n}.pth`` / ``iter_{n}.pth`` (a sharded checkpoint is a directory of
the same name), or by a CheckpointHook ``filename_tmpl`` such as ``ckpt_{}.pth``; the ``last_checkpoint``
file names the one to resume from and is rewritten atomically only after that checkpoint is complete,
so it never points at a partial file. It always lives in the work dir, also when the checkpoints
are written elsewhere (CheckpointHook ``out_dir``: it then holds their absolute path).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from memfit.checkpoint.io import write_text_atomic
from memfit.errors import CheckpointError

LATEST_FILE = "last_checkpoint"
_NAME_RE = re.compile(r"^(epoch|iter)_(\d+)(\.pth)?$")

logger = logging.getLogger("memfit")


def write_latest(work_dir: str | Path, filename: str | Path) -> None:
    """Point ``work_dir/last_checkpoint`` at ``filename``; call only after the checkpoint is complete.

    A checkpoint inside ``work_dir`` is recorded by its name relative to the work dir, so the
    directory can be moved or mounted elsewhere and still resume.
    """
    work_dir = Path(work_dir)
    target = Path(filename)
    if not target.is_absolute():
        target = work_dir / target
    try:
        text = str(target.resolve().relative_to(work_dir.resolve()))
    except ValueError:
        text = str(target.resolve())
    write_text_atomic(work_dir / LATEST_FILE, text)


def read_latest(work_dir: str | Path) -> Path | None:
    """The checkpoint to resume from in ``work_dir``, or None when there is none.

    Normally the file ``last_checkpoint`` names. If it names a file that no longer exists, or
    the pointer is missing while checkpoints exist (a kill between the rename of the first
    checkpoint and the pointer write), the newest complete checkpoint is used with a warning;
    temporary ``.*.tmp-*`` files are never candidates.
    """
    work_dir = Path(work_dir)
    pointer = work_dir / LATEST_FILE
    named: Path | None = None
    if pointer.is_file():
        text = pointer.read_text().strip()
        if text:
            named = Path(text) if Path(text).is_absolute() else work_dir / text
            if named.exists():
                return named
            # A crash while a directory checkpoint of the same name was being replaced left the
            # previous one set aside (memfit.checkpoint.directory.publish): it is still complete.
            aside = sorted(named.parent.glob(f".{named.name}.old-*"))
            if aside:
                logger.warning(f"{pointer} names {named}, which a crash left set aside as {aside[-1].name}: using it")
                return aside[-1]
    # Checkpoints written to an out_dir are looked for there (the pointer names that folder).
    found = find_checkpoints(named.parent if named is not None else work_dir)
    if not found:
        if named is not None:
            logger.warning(
                f"{pointer} names {named}, which does not exist, and {work_dir} has no checkpoints"
            )
        return None
    newest = found[-1]
    why = f"names {named}, which does not exist" if named is not None else "is missing or empty"
    logger.warning(f"{pointer} {why}: resuming from the newest complete checkpoint {newest}")
    return newest


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint a path given by the user stands for (``--resume``, ``resume=``, ``load_from=``,
    ``memfit eval``, ``memfit export``): every caller resolves it here.

    A file, a path that does not exist (the loader's error names it) and a sharded checkpoint directory
    (holding ``memfit_state.pth`` or DCP's ``.metadata``) are returned as they are. A work dir (holding
    ``last_checkpoint`` or ``epoch_N``/``iter_N`` checkpoints) gives its last checkpoint (:func:`read_latest`),
    said in one line through ``log`` (default: the memfit logger's info). Any other directory is a
    CheckpointError saying what was expected.
    """
    from memfit.checkpoint.dcp import is_dcp_checkpoint
    from memfit.checkpoint.directory import EXTRAS_FILE, is_directory_checkpoint

    path = Path(path)
    if not path.is_dir() or is_directory_checkpoint(path) or is_dcp_checkpoint(path):
        return path
    latest = read_latest(path)  # None, without a word, when it holds neither a pointer nor checkpoints
    if latest is None:
        raise CheckpointError(f"{path}: a directory without a checkpoint: give a checkpoint file, a sharded checkpoint "
                              f"directory (holding {EXTRAS_FILE} or .metadata) or a work dir holding {LATEST_FILE} or "
                              "epoch_N.pth / iter_N.pth")
    (log or logger.info)(f"{path} is a work dir: using its last checkpoint {latest}")
    return latest


def checkpoint_position(path: str | Path) -> int | None:
    """The epoch or iteration number in a checkpoint name (``epoch_3.pth`` -> 3), else None."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(2)) if match else None


def latest_target(work_dir: str | Path) -> Path | None:
    """The path ``work_dir/last_checkpoint`` names (whether or not it exists), or None."""
    pointer = Path(work_dir) / LATEST_FILE
    text = pointer.read_text().strip() if pointer.is_file() else ""
    if not text:
        return None
    return Path(text) if Path(text).is_absolute() else Path(work_dir) / text


def find_checkpoints(work_dir: str | Path, filename_tmpl: str | None = None) -> list[Path]:
    """The ``epoch_{n}.pth`` / ``iter_{n}.pth`` checkpoints in ``work_dir``, oldest first.

    Sorted by the number in the name (then modification time), not by name, so ``iter_10``
    follows ``iter_9``. Best-metric checkpoints and temporary files do not match and are excluded.
    ``filename_tmpl`` (one ``{}`` for the number, e.g. ``ckpt_{}.pth``) matches those names instead.
    """
    work_dir = Path(work_dir)
    if not work_dir.is_dir():
        return []
    if filename_tmpl is not None:
        before, after = filename_tmpl.split("{}", 1)
        pattern = re.compile(f"^{re.escape(before)}(\\d+){re.escape(after)}$")
    found = []
    for path in work_dir.iterdir():
        if filename_tmpl is not None:
            match = pattern.match(path.name)
            if match:
                found.append((int(match.group(1)), path.stat().st_mtime, path))
            continue
        match = _NAME_RE.match(path.name)
        # A bare ``epoch_3`` is a sharded (directory) checkpoint; ``epoch_3.pth`` may be either.
        if match and (match.group(3) or path.is_dir()):
            found.append((int(match.group(2)), path.stat().st_mtime, path))
    return [path for _, _, path in sorted(found)]


def format_clash(folder: str | Path, filename_tmpl: str, done: int, sharded: bool) -> str | None:
    """One line when ``folder`` holds a checkpoint under a name this run will write, in the other form.

    The names are ``filename_tmpl`` (and the ``best_<metric>_`` ones) numbered above ``done`` (the
    epoch or iteration the run starts at); the other form is a directory of shards where this run
    writes single files (``sharded=False``), or a file where it writes directories. Such a checkpoint
    belongs to another run: a save would fail on it (or replace it) only when training gets there.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    before, after = filename_tmpl.split("{}", 1)
    pattern = re.compile(f"^(best_.+_)?{re.escape(before)}(\\d+){re.escape(after)}$")
    for path in sorted(folder.iterdir()):
        match = pattern.match(path.name)
        if match and int(match.group(2)) > done and path.is_dir() != sharded:
            theirs, ours = ("a single-file", "directories of shards") if sharded else ("a sharded", "single files")
            return (f"{path} is {theirs} checkpoint of another run, and this run writes its checkpoints as {ours} "
                    "under the same names: continue that run with resume=True (--resume) and its own strategy, "
                    "set work_dir to another folder, or remove the old checkpoints")
    return None


def remove_old(work_dir: str | Path, keep: int, protect: Iterable[str | Path] = (),
               filename_tmpl: str | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (``max_keep_ckpts``); return what was removed.

    Never removes a path in ``protect`` (the best checkpoint) nor the one ``last_checkpoint``
    points to. ``keep <= 0`` keeps everything, as MMEngine's ``max_keep_ckpts=-1``.
    ``filename_tmpl``: as in :func:`find_checkpoints`.
    """
    if keep <= 0:
        return []
    work_dir = Path(work_dir)
    protected = {Path(p).resolve() for p in protect}
    target = latest_target(work_dir)
    if target is not None:
        protected.add(target.resolve())
    removed = []
    for path in find_checkpoints(work_dir, filename_tmpl)[:-keep]:
        if path.resolve() in protected:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    return removed
