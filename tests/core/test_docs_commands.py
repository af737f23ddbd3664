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
from pathlib import Path

import pytest

from memfit.cli import build_parser, main
from tests.core._docs_commands import KINDS, PAGES, ROOT, Command, documented_commands, inline_commands, resolved_word

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
        word = resolved_word(word)
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
    if command.kind == "calibrate":  # no config: it measures the GPU it runs on
        assert args.calibrate and args.config is None, f"{command}: --calibrate takes no config"
        return
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
