"""The command line's own values, checked before any work starts: counts that must be positive and the files a
command writes (not a folder; in a folder that exists or can be made, and that takes a new file). Each is
refused in one line naming the flag and what it takes (:class:`memfit.errors.ConfigError`: exit status 2), not
after minutes of planning or measuring, nor as a bare Python error."""

from __future__ import annotations

import argparse
from pathlib import Path

from memfit.errors import ConfigError
from memfit.log_dir import unwritable

# (command, option): (flag, what it counts, least value); train's launch flags are memfit.launch's to check
COUNTS = {
    ("plan", "gpus"): ("--gpus", "ranks per machine", 1),
    ("plan", "nodes"): ("--nodes", "machines", 1),
    ("plan", "top"): ("--top", "rows to print", 1),
    ("bench", "steps"): ("--steps", "timed steps per plan", 1),
    ("data", "num"): ("--num", "images", 1),
    ("data", "max_shapes"): ("--max-shapes", "most shapes in an image", 1),
}
# (command, option): (flag, an example file name in a folder given instead, suffixes it may have; () any)
OUTPUTS = {
    ("plan", "json"): ("--json", "plan.json", ()),
    ("plan", "png"): ("--png", "plan.png", "chart"),
    ("bench", "json"): ("--json", "bench.json", ()),
    ("export", "out"): ("--out", "model.safetensors", ()),
    ("convert", "out"): ("--out", "config.py", (".py", ".yaml", ".yml")),
}


def check_args(args: argparse.Namespace) -> None:
    """Refuse ``args`` of ``args.command`` that no run could use (see the module docstring)."""
    for (command, dest), (flag, what, least) in COUNTS.items():
        value = getattr(args, dest, None)
        if command == args.command and value is not None and value < least:
            raise ConfigError(f"{flag} {value}: give the number of {what} (at least {least})")
    for (command, dest), (flag, example, suffixes) in OUTPUTS.items():
        if command == args.command and getattr(args, dest, None):
            check_output(flag, getattr(args, dest), example, suffixes)
    if args.command == "data":
        check_folder("--out", args.out)


def check_output(flag: str, path: str | Path, example: str, suffixes: tuple[str, ...] | str = ()) -> None:
    """Refuse ``path`` (given as ``flag``) as a file to write: a folder (``example`` names a file in it), a name whose
    suffix is not among ``suffixes`` (``"chart"``: what matplotlib writes; none adds .png), or a place where no file
    can be made (under a file, a read-only or special file system): the nearest folder that exists must take a
    new file, which this tries."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: a folder: give a file path, e.g. {p / example}")
    if suffixes == "chart":
        from matplotlib.backend_bases import FigureCanvasBase

        known = [f".{ext}" for ext in FigureCanvasBase.get_supported_filetypes()]
        suffixes = tuple(sorted(known, key=lambda ext: ext not in (".png", ".svg", ".pdf")))  # the usual first
        if not p.suffix:
            return check_output(flag, p.with_suffix(".png"), example)
    if suffixes and p.suffix.lower() not in suffixes:
        kinds = ", ".join(suffixes[:3]) + (", ..." if len(suffixes) > 3 else "")
        raise ConfigError(f"{flag} {path}: not a {kinds} file: give e.g. {p.with_name(example)}")
    _writable(flag, path, p.absolute().parent)


def check_folder(flag: str, path: str | Path) -> None:
    """Refuse ``path`` (given as ``flag``) as a folder to write files in: a file, or where none can be made."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: a file, not a folder: give a folder to write in")
    _writable(flag, path, p.absolute())


def _writable(flag: str, given: str | Path, folder: Path) -> None:
    """Raise unless the nearest of ``folder`` and its parents that exists is a folder that takes a new file."""
    problem = unwritable(folder)
    if problem:
        raise ConfigError(f"{flag} {given}: cannot write there ({problem}): give a path in a writable folder")
