"""A run's timestamped folder, ``work_dir/<timestamp>/`` (its log, dumped config, scalars): made when
a Runner is built, as MMEngine does, and taken away again by the ``memfit`` command when the run was
refused before it started, so a bad config value leaves no folder holding only a log behind. Also the
probe that says, before anything is written, why a folder cannot take a run's files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memfit.errors import ConfigError, MemfitError, failure_summary

_TIMESTAMP = re.compile(r"^\d{8}_\d{6}$")


def make_log_dir(work_dir: Path, timestamp: str, given: str | Path) -> Path:
    """Create ``work_dir/timestamp`` (rank 0 calls it); ``given`` is the work_dir as the user wrote it."""
    log_dir = work_dir / timestamp
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission, a read-only file system
        raise ConfigError(f"work_dir={str(given)!r}: cannot create {log_dir}: {exc.strerror}: "
                          "set work_dir (or --work-dir) to a writable folder") from None
    return log_dir


def unwritable(folder: Path) -> str | None:
    """Why no file could be written in ``folder`` (made as needed), as ``'<nearest>: <reason>'``, or None: the
    nearest of it and its parents that exists must be a folder that takes a new file. Creates nothing."""
    nearest = next(q for q in (folder, *folder.parents) if q.exists())
    try:
        if not nearest.is_dir():
            raise NotADirectoryError(0, "not a folder")
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as exc:
        return f"{nearest}: {exc.strerror or exc}"
    return None


@contextlib.contextmanager
def removed_if_refused(work_dir: str | Path) -> Iterator[None]:
    """Run the body (building and starting a run); if it refuses the input before the run starts (a
    MemfitError, such as a ConfigError or CheckpointError, that no loop marked as a failure), remove
    the timestamped folders it created that hold nothing but their log and dumped config, and the
    folders above them it created, now empty. The error line itself goes to the console."""
    work_dir = Path(work_dir).resolve()
    created = [p for p in (work_dir, *work_dir.parents) if not p.exists()]  # deepest first
    before = set(os.listdir(work_dir)) if work_dir.is_dir() else set()
    try:
        yield
    except MemfitError as exc:
        if failure_summary(exc) is None and os.environ.get("RANK", "0") == "0":
            _remove_new_log_dirs(work_dir, before)
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:  # not empty: keep it and everything above it
                    break
        raise


def _remove_new_log_dirs(work_dir: Path, before: set[str]) -> None:
    if not work_dir.is_dir():
        return
    for name in sorted(set(os.listdir(work_dir)) - before):
        folder = work_dir / name
        if not (_TIMESTAMP.match(name) and folder.is_dir()):
            continue
        entries = list(folder.iterdir())
        if not all(p.is_file() and p.name in (f"{name}.log", "config.py") for p in entries):
            continue
        logger = logging.getLogger("memfit")
        for handler in list(logger.handlers):  # stop writing into it before it goes
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder:
                logger.removeHandler(handler)
                handler.close()
        shutil.rmtree(folder, ignore_errors=True)
