"""Collecting the commands README.md and docs/*.md show, for tests/core/test_docs_commands.py: each page's
```bash lines and `memfit ...` spans, split into words, placeholders resolved, and each given its kind."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What the pages write in place of a real argument, and what the test uses instead. Paths relative to the
# repository (configs/, benchmarks/) are made absolute; other relative paths land in the test's directory.
PLACEHOLDERS = {"CFG": "configs/vit_shapes.py", "CKPT": "work_dirs/exp/epoch_12.pth",
                "CHECKPOINT": "work_dirs/exp/epoch_12.pth"}

# How each kind of command is checked, and why. "run": memfit.cli.main(argv) must return 0 (or exit 0);
# "parse": the parser accepts it and its config, sizes and GPU names are valid; "exists": what it names exists.
KINDS = {
    "help": ("run", "--help and --version print and exit"),
    "convert": ("run", "prints or writes a config: well under a second"),
    "data": ("run", "writes shapes-coco with --num lowered to 8 images (the documented sizes take seconds)"),
    "plan-as-is": ("run", "one fake step of the small demo config: about a second"),
    "export": ("run", "on the checkpoint the README's Python example wrote (its work dir, or a file in it)"),
    "train": ("parse", "trains for minutes; the README's Python example trains for real below"),
    "multi-process": ("parse", "--gpus/torchrun/Slurm start several processes, on GPUs"),
    "plan": ("parse", "every plan, or a large config: 10 s to a minute of fake steps"),
    "bench": ("parse", "measures several plans: minutes"),
    "calibrate": ("parse", "measures this machine's GPU (CUDA only), under a minute; takes no config"),
    "eval": ("parse", "needs a checkpoint trained from that config"),
    "synopsis": ("parse", "a usage line ([optional] parts): each --flag must be an option of the subcommand"),
    "make": ("exists", "make demo and make test take minutes: the target and its variables exist in the Makefile"),
    "pip": ("exists", "installs: its extras are pyproject.toml's and a pinned version is the one the Makefile uses"),
    "script": ("exists", "a benchmark runs for minutes, often on a GPU: the script exists"),
}
# Configs small enough that `memfit plan CFG --as-is` runs here in about a second.
QUICK_PLAN_CONFIGS = {"configs/vit_shapes.py"}


@dataclass(frozen=True)
class Command:
    page: str  # e.g. 'docs/runner.md:12'
    line: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # for memfit: the arguments after 'memfit'; otherwise the whole command line
    kind: str

    def __str__(self) -> str:
        return f"{self.page}: {self.line}"


def _bash_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of every command in the page's ```bash/```sh blocks, backslash continuations joined."""
    out, lang, pending, start = [], None, "", 0
    for number, text in enumerate(page.read_text().splitlines(), 1):
        stripped = text.strip()
        if stripped.startswith("```"):
            lang = None if lang is not None else (stripped[3:].strip() or "text")
            continue
        if lang not in ("bash", "sh", "shell"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def _split(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def _memfit_argv(words: list[str]) -> list[str] | None:
    """The arguments after 'memfit' in 'memfit ...', 'python -m memfit ...' or 'torchrun ... -m memfit ...'."""
    if words and words[0] == "memfit":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "memfit":
            return words[i + 2:]
    return None


def _kind(words: list[str], argv: list[str] | None) -> str | None:
    if argv is None:
        if words[:1] == ["make"]:
            return "make"
        if "install" in words and any(w == "pip" or w.endswith("/pip") for w in words):
            return "pip"
        if any(w.endswith(".py") and w.startswith("benchmarks/") for w in words):
            return "script"
        return None
    if argv == ["..."] or not argv:
        return None  # 'python -m memfit ...': the same command, no arguments to check
    if any(w.startswith("[") for w in argv):
        return "synopsis"
    if {"-h", "--help", "--version"} & set(argv):
        return "help"
    if words[0] in ("torchrun", "srun") or argv[0] == "train" and ("--gpus" in argv or "--launcher" in argv):
        return "multi-process"
    command = argv[0]
    if command == "plan" and "--as-is" in argv and resolved_word(argv[1]) in QUICK_PLAN_CONFIGS:
        return "plan-as-is"
    if command == "data":
        return "data"
    if command == "bench" and "--calibrate" in argv:
        return "calibrate"
    return command if command in KINDS else "unknown"


def resolved_word(word: str) -> str:
    return PLACEHOLDERS.get(word, word)


def documented_commands() -> list[Command]:
    commands = []
    for page in PAGES:
        for number, line in _bash_lines(page):
            words = _split(line)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # PYTHONPATH=. CUDA_VISIBLE_DEVICES=0 ...
                words = words[1:]
            if not words:
                continue
            argv = _memfit_argv(words)
            kind = _kind(words, argv)
            if kind is not None:
                where = f"{page.relative_to(ROOT)}:{number}"
                commands.append(Command(where, line.split(" #")[0].strip(), tuple(argv or words), kind))
    return commands


# Placeholders of the text's `memfit ...` spans, as values the parser takes.
INLINE_PLACEHOLDERS = {"N": "8", "M": "2", "PATH": "work_dirs/exp", "FILE": "work_dirs/exp/epoch_1.pth",
                       "DIR": "data/shapes_coco", "BUDGET": "24GiB", "KEY=VALUE": "train_cfg.max_epochs=1",
                       "COMMAND": "train"}


def inline_commands() -> list[Command]:
    """`memfit COMMAND ...` spans in the pages' text with at least one argument, not a usage line."""
    out = []
    for page in PAGES:
        in_block = False
        for number, text in enumerate(page.read_text().splitlines(), 1):
            in_block ^= text.strip().startswith("```")
            for span in ([] if in_block else re.findall(r"`(memfit [^`]+)`", text)):
                words = span.split()
                if len(words) > 2 and not any(w.startswith("[") or w == "..." for w in words):
                    argv = tuple(INLINE_PLACEHOLDERS.get(w, w) for w in words[1:])
                    out.append(Command(f"{page.relative_to(ROOT)}:{number}", span, argv, "inline"))
    return out
