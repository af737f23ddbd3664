"""The commands README.md and docs/*.md show still work as written.

Every line of a ```bash block that runs memfit (``memfit ...``, ``python -m memfit ...``,
``torchrun ... -m memfit ...``), make, pip or a benchmark script is collected and checked by its kind,
listed in KINDS with the reason: the quick ones run for real through ``memfit.cli.main`` (in a temporary
directory, placeholders such as CFG replaced), the slow ones are parsed by the command's own argparse
parser, their config files loaded with their ``--cfg-options`` and validated, and their sizes and GPU
names checked, so a renamed flag, subcommand, config file or config key fails here. Commands quoted in the
text (`memfit ...` spans) must parse too, the links between the pages must name a file and a heading they have,
the README's first screen must say what to type, and its Python example runs as written.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from memfit.cli import build_parser, main

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
    if command == "plan" and "--as-is" in argv and _resolved(argv[1]) in QUICK_PLAN_CONFIGS:
        return "plan-as-is"
    if command == "data":
        return "data"
    return command if command in KINDS else "unknown"


def _resolved(word: str) -> str:
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


COMMANDS = documented_commands()


def _ids(commands: list[Command]) -> list[str]:
    return [f"{c.page} {' '.join(c.argv)}"[:100] for c in commands]


def test_every_documented_command_has_a_kind():
    """A new subcommand or a new sort of line must be given a kind (and a reason) in KINDS."""
    unknown = [str(c) for c in COMMANDS if c.kind not in KINDS]
    assert not unknown, f"classify these in KINDS: {unknown}"
    kinds = {c.kind for c in COMMANDS}
    assert {"help", "convert", "data", "plan-as-is", "export", "train", "plan", "eval", "make", "pip"} <= kinds, (
        f"the pages' commands were not all found (kinds seen: {sorted(kinds)})")
    assert any(c.page.startswith("README.md") for c in COMMANDS)


def _real_argv(argv: tuple[str, ...], checkpoint_dir: Path | None = None) -> list[str]:
    """The argv with placeholders replaced, repository paths made absolute, shapes-coco made small and an
    export's checkpoint pointed at the README example's (a file in it, or its work dir)."""
    out = []
    for i, word in enumerate(argv):
        word = _resolved(word)
        if word.startswith(("configs/", "benchmarks/")):
            word = str(ROOT / word)
        elif i and argv[i - 1] == "--num":
            word = "8"
        elif argv[0] == "export" and i == 1 and checkpoint_dir is not None:
            word = str(checkpoint_dir / "epoch_3.pth" if word.endswith(".pth") else checkpoint_dir)
        out.append(word)
    if argv[:2] == ("data", "shapes-coco") and "--num" not in argv:
        out += ["--num", "8"]
    return out


def _parse(argv: list[str], command: Command):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{command}: memfit's parser refused it (exit {exc.code})")


def test_readme_first_screen_says_what_to_type():
    """The README's first 60 lines: install, the two make commands and the train, plan and auto-fit examples,
    and nothing about how memfit was made."""
    screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for needed in ("pip install -e", "make venv", "make demo", "make test", "memfit train configs/", "memfit plan ",
                   "--auto-fit"):
        assert needed in screen, f"README.md's first 60 lines do not show {needed!r}"
    for word in ("the seeds", "seed's", "session", "commit"):
        assert word not in screen.lower(), f"README.md's first 60 lines say {word!r}"


# --- the commands run for real -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def readme_example(tmp_path_factory) -> Path:
    """Run the README's ```python blocks as written, in a directory of their own; return the run's work dir."""
    import os

    import torch

    torch.manual_seed(0)  # the example builds its model before the Runner seeds: its first weights are drawn here
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks, "README.md has no ```python example"
    cwd, where = Path.cwd(), tmp_path_factory.mktemp("readme_example")
    os.chdir(where)
    try:
        for block in blocks:
            exec(compile(block, str(ROOT / "README.md"), "exec"), {"__name__": "readme_example"})
    finally:
        os.chdir(cwd)
    work_dirs = [p for p in (where / "work_dirs").iterdir() if p.is_dir()]
    assert len(work_dirs) == 1, work_dirs
    return work_dirs[0]


def test_readme_python_example_trains(readme_example):
    """The README's example trains and validates as it says (4 classes: chance is 25%)."""
    assert (readme_example / "epoch_3.pth").is_file()
    rows = [json.loads(x) for x in next(readme_example.glob("*/scalars.jsonl")).read_text().splitlines()]
    accuracy = [r["val/accuracy/top1"] for r in rows if "val/accuracy/top1" in r]
    assert len(accuracy) == 3 and accuracy[-1] > 90, accuracy


def _once(commands: list[Command]) -> list[Command]:
    """One of each argv (the same command on several pages runs once), naming every page that shows it."""
    pages: dict[tuple[str, ...], list[Command]] = {}
    for c in commands:
        pages.setdefault(c.argv, []).append(c)
    return [Command(", ".join(c.page for c in cs), cs[0].line, argv, cs[0].kind) for argv, cs in pages.items()]


RUN = _once([c for c in COMMANDS if KINDS.get(c.kind, ("",))[0] == "run"])


@pytest.mark.parametrize("command", RUN, ids=_ids(RUN))
def test_quick_command_runs(command, readme_example, capsys):
    argv = _real_argv(command.argv, readme_example)
    try:
        code = main(argv)
    except SystemExit as exc:  # --help, --version
        code = exc.code
    captured = capsys.readouterr()
    assert code == 0, f"{command}\nran as: memfit {shlex.join(argv)}\n{captured.out[-2000:]}{captured.err[-2000:]}"
    assert captured.out or captured.err, f"{command}: printed nothing"


# --- the slow commands: parsed and checked -------------------------------------------------------------------

PARSE = [c for c in COMMANDS if KINDS.get(c.kind, ("",))[0] == "parse" and c.kind != "synopsis"]


@pytest.mark.parametrize("command", PARSE, ids=_ids(PARSE))
def test_slow_command_parses(command):
    from memfit.config import Config, parse_cfg_options, validate_config
    from memfit.planner.devices import gpu, parse_bytes
    from memfit.planner.inputs import parse_input_shape

    argv = _real_argv(command.argv)
    args = _parse(argv, command)
    for key in ("budget", "gpu_mem"):
        if getattr(args, key, None):
            parse_bytes(getattr(args, key), "--" + key.replace("_", "-"))
    if getattr(args, "auto_fit", None) not in (None, "free"):
        parse_bytes(args.auto_fit, "--auto-fit")
    if getattr(args, "gpu", None):
        gpu(args.gpu)
    if getattr(args, "input_shape", None):
        parse_input_shape(args.input_shape)
    config = Path(args.config)
    assert config.is_file(), f"{command}: no config {config}"
    cfg = Config.fromfile(config)
    if args.cfg_options:
        cfg.merge_from_dict(parse_cfg_options(args.cfg_options))
    validate_config(cfg)
    if isinstance(cfg.get("strategy"), str):
        from memfit.strategies import SHORT_NAMES

        assert cfg["strategy"] in SHORT_NAMES, f"{command}: no strategy named {cfg['strategy']!r}"
    if getattr(args, "auto_scale_lr", False):
        assert (cfg.get("auto_scale_lr") or {}).get("base_batch_size"), f"{command}: the config has no base_batch_size"


SYNOPSES = [c for c in COMMANDS if c.kind == "synopsis"]


@pytest.mark.parametrize("command", SYNOPSES, ids=_ids(SYNOPSES))
def test_usage_line_names_real_options(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command.argv[0]]
    options = {s for a in sub._actions for s in a.option_strings}
    flags = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(command.argv[1:]))
    missing = [f for f in flags if f not in options]
    assert not missing, f"{command}: not options of 'memfit {command.argv[0]}': {missing}"


# --- commands quoted in the text -----------------------------------------------------------------------------

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


INLINE = inline_commands()


@pytest.mark.parametrize("command", INLINE, ids=_ids(INLINE))
def test_quoted_command_parses(command, monkeypatch):
    """A command quoted in a sentence may leave out a required option, but every word it has must be one the
    parser takes (`memfit export iter_8.pth model.safetensors` is refused: the output needs --out)."""
    import argparse

    def error(parser, message):
        raise ValueError(message)

    monkeypatch.setattr(argparse.ArgumentParser, "error", error)
    parser = build_parser()
    for sub in next(a for a in parser._actions if a.dest == "command").choices.values():
        for action in sub._actions:
            action.required = action.required and not action.option_strings  # --out may be left out of a sentence
    try:
        parser.parse_args(_real_argv(command.argv))
    except SystemExit as exc:  # --help
        assert exc.code == 0, f"{command}: exit {exc.code}"
    except ValueError as exc:
        named_only = command.argv[-1].startswith("--") and str(exc).endswith("expected one argument")
        assert named_only or str(exc).startswith("the following arguments are required"), f"{command}: {exc}"


# --- make, pip, scripts --------------------------------------------------------------------------------------

MAKEFILE = (ROOT / "Makefile").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()
EXISTS = [c for c in COMMANDS if KINDS.get(c.kind, ("",))[0] == "exists"]


@pytest.mark.parametrize("command", EXISTS, ids=_ids(EXISTS))
def test_named_target_extra_or_script_exists(command):
    words = list(command.argv)
    if command.kind == "make":
        for word in words[1:]:
            if "=" in word:
                name = word.split("=")[0]
                assert re.search(rf"^{name}\s*[?:]?=", MAKEFILE, re.M), f"{command}: the Makefile has no {name}"
            else:
                assert re.search(rf"^{re.escape(word)}:", MAKEFILE, re.M), f"{command}: no Makefile target {word}"
    elif command.kind == "pip":
        extras = set(re.findall(r"^(\w+) = \[", PYPROJECT.split("[project.optional-dependencies]")[1].split("\n[")[0],
                                re.M))
        for word in words:
            if word.startswith(".["):
                named = set(word[2:-1].split(","))
                assert named <= extras, f"{command}: no extra {sorted(named - extras)} in pyproject.toml"
            elif "==" in word:
                assert word in MAKEFILE or word in PYPROJECT, (
                    f"{command}: {word} is not the version the Makefile or pyproject.toml pins")
            elif re.fullmatch(r"memfit(\[.*\])?", word):
                pytest.fail(f"{command}: memfit is not on a package index: pip install -e '.[...]' from the checkout")
    else:
        scripts = [w for w in words if w.endswith(".py")]
        assert scripts and all((ROOT / s).is_file() for s in scripts), f"{command}: no such script"


# --- links between the pages ---------------------------------------------------------------------------------

def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_pages_resolve():
    """Every link from README.md or docs/*.md to a page of this repository names a file and a heading it has."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
