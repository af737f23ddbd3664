"""``Config``: a dict with attribute access, loaded from Python, YAML or JSON files with ``_base_`` inheritance.

A Python config is executed as MMEngine executes it: its top-level names form the config. Names that
start with ``_`` are helpers, and names bound by ``import``, ``def`` or ``class`` are definitions, so
neither becomes a key (a class imported at the top stays a value where it is used, as in
``type=SGD``). ``_base_`` names one file or a list of files, resolved relative to the file that
names them; they are merged in order and the file's own keys are merged on top. Dict values merge
recursively unless the overriding dict carries ``_delete_=True``; any other value replaces. A file reads its
bases' values through ``{{_base_.name}}`` and, in Python, ``_base_`` itself (:mod:`memfit.config.base_refs`). A YAML
file whose root key is ``config:`` is a VISSL config, translated by :mod:`memfit.config.vissl`.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import sys
import traceback
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from memfit.config.base_refs import BASE_KEY, fill_refs, hold_refs, python_bases
from memfit.config.vissl import is_vissl_config, translate_vissl
from memfit.errors import ConfigError, nearest

DELETE_KEY = "_delete_"
PYTHON_SUFFIXES = (".py",)
YAML_SUFFIXES = (".yaml", ".yml")
JSON_SUFFIXES = (".json",)


class Config(dict):
    """A dict whose keys are also attributes (``cfg.train_cfg.max_epochs``).

    Nested dicts become ``Config`` too, including dicts inside lists and tuples, so attribute access
    works at any depth. A missing attribute raises ``AttributeError`` naming the nearest key, which
    keeps ``hasattr``/``getattr(..., default)``, ``copy`` and ``pickle`` working as for any object.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    # -- attribute access -------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            close = nearest(name, [k for k in self if isinstance(k, str)], n=1)
            hint = f": did you mean {close[0]!r}?" if close else ""
            raise AttributeError(f"config has no key {name!r}{hint}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {k for k in self if isinstance(k, str) and k.isidentifier()})

    # -- writes convert nested dicts (dict.update/setdefault bypass __setitem__) ---------------
    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _wrap(value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self) -> Config:
        """A shallow copy that is still a ``Config``."""
        return Config(self)

    def __copy__(self) -> Config:
        return self.copy()

    def __repr__(self) -> str:
        return f"Config({dict.__repr__(self)})"

    # -- public API --------------------------------------------------------------------------------
    @classmethod
    def fromfile(cls, path: str | Path) -> Config:
        """Load a ``.py``, ``.yaml``, ``.yml`` or ``.json`` config with its ``_base_`` chain resolved.

        Every error (missing file or base, syntax error, exception while executing the file, a
        ``_base_`` cycle) is a one-line ``ConfigError`` naming the file and, where known, the line.
        """
        path = Path(path).expanduser()
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a directory: give the .py or .yaml file in it")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        return cls(_load(path.resolve(), ()))

    def merge_from_dict(self, options: Mapping[str, Any]) -> None:
        """Merge dotted-key overrides (``{'optim_wrapper.accumulative_counts': 4}``) into this config.

        A numeric part indexes a list (``param_scheduler.0.end``); missing dict levels are created;
        a dict value merges into an existing dict (``_delete_=True`` replaces it); any other value
        replaces. This is what ``--cfg-options`` does after ``parse_cfg_options``.
        """
        for dotted, value in options.items():
            _set_dotted(self, dotted, value)

    def to_dict(self) -> dict:
        """The same config as plain dicts, lists and tuples (leaf values are shared, not copied)."""
        return _unwrap(self)


def _wrap(value: Any) -> Any:
    """Convert dicts (also inside lists and tuples) to ``Config``; an existing Config is kept as is."""
    if isinstance(value, Config):
        return value
    if isinstance(value, dict):
        return Config(value)
    if type(value) is list:
        return [_wrap(v) for v in value]
    if type(value) is tuple:  # not subclasses: a NamedTuple or torch.Size keeps its own type
        return tuple(_wrap(v) for v in value)
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if type(value) is list:
        return [_unwrap(v) for v in value]
    if type(value) is tuple:
        return tuple(_unwrap(v) for v in value)
    return value


# -- merging ---------------------------------------------------------------------------------------
def merge_dicts(base: Mapping, override: Mapping) -> dict:
    """Return ``base`` with ``override`` merged on top, without changing either.

    Dicts merge recursively; a dict in ``override`` with ``_delete_=True`` replaces the base dict
    instead; every other value replaces. ``_delete_`` never survives into the result.
    """
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping) and not value.get(DELETE_KEY, False):
            merged[key] = merge_dicts(old, value)
        else:
            merged[key] = strip_delete(value)
    merged.pop(DELETE_KEY, None)
    return merged


def strip_delete(value: Any) -> Any:
    """Remove every ``_delete_`` marker from ``value`` (dicts, also inside lists and tuples)."""
    if isinstance(value, Mapping):
        return {k: strip_delete(v) for k, v in value.items() if k != DELETE_KEY}
    if type(value) is list:
        return [strip_delete(v) for v in value]
    if type(value) is tuple:
        return tuple(strip_delete(v) for v in value)
    return value


def _set_dotted(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(
            f"config override key {dotted!r} has an empty part: write e.g. 'optim_wrapper.optimizer.lr'"
        )
    node: Any = cfg
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        parent = ".".join(parts[:depth]) or "config"
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(
                    f"config override {dotted!r}: {parent!r} is a list, so {part!r} must be an index"
                )
            index = int(part)
            if index >= len(node):
                raise ConfigError(
                    f"config override {dotted!r}: index {index} is out of range "
                    f"({parent!r} has {len(node)} items)"
                )
            key: Any = index
        elif isinstance(node, dict):
            if part.isdigit() and part not in node:
                raise ConfigError(
                    f"config override {dotted!r}: {parent!r} is a dict, "
                    f"not a list, so index {part} does not apply"
                )
            key = part
        else:
            raise ConfigError(
                f"config override {dotted!r}: {parent!r} is a {type(node).__name__} "
                f"({node!r}), not a dict or list; set it as a whole instead"
            )
        if last:
            old = node[key] if isinstance(node, list) or key in node else None
            if isinstance(value, Mapping) and isinstance(old, Mapping) and not value.get(DELETE_KEY, False):
                node[key] = merge_dicts(old, value)
            else:
                node[key] = strip_delete(value)
            if isinstance(node, list):
                node[key] = _wrap(node[key])  # list items bypass Config.__setitem__
            return
        if isinstance(node, dict) and key not in node:
            node[key] = Config()
        node = node[key]


# -- loading ---------------------------------------------------------------------------------------
def _load(path: Path, chain: tuple[Path, ...]) -> dict:
    """Load one file and its bases; ``chain`` holds the files that led here (to catch cycles)."""
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"config _base_ cycle: {cycle}")
    if path.suffix not in PYTHON_SUFFIXES + YAML_SUFFIXES + JSON_SUFFIXES:
        raise ConfigError(
            f"config file {str(path)!r}: unsupported suffix {path.suffix!r} (use .py, .yaml, .yml or .json)"
        )
    text, held = hold_refs(path.read_text(encoding="utf-8"))
    if path.suffix in PYTHON_SUFFIXES:
        tree, spec = python_bases(_parse_python(text, path), path)
        bases = _merged_bases(spec, path, chain)
        own = _load_python(path, tree, bases)
    else:
        own = _load_yaml(path, text) if path.suffix in YAML_SUFFIXES else _load_json(path, text)
        if is_vissl_config(own):  # VISSL's dialect (root key 'config:'), translated key by key
            try:
                own = translate_vissl(own)
            except ConfigError as exc:
                raise ConfigError(f"config {path}: {exc}") from None
        bases = _merged_bases(own.pop(BASE_KEY, None), path, chain)
    return merge_dicts(bases, fill_refs(own, held, bases, path))


def _merged_bases(spec: Any, path: Path, chain: tuple[Path, ...]) -> Config:
    """The ``_base_`` files merged in order, as a Config (a Python config reads it as ``_base_`` while it runs)."""
    merged: dict = {}
    for base in _base_paths(spec, path):
        merged = merge_dicts(merged, _load(base, (*chain, path)))
    return Config(merged)


def _base_paths(spec: Any, path: Path) -> Iterator[Path]:
    if spec is None:
        return
    names = [spec] if isinstance(spec, (str, Path)) else spec
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, (str, Path)) for n in names):
        raise ConfigError(f"config {path}: _base_ must be a file name or a list of file names, got {spec!r}")
    for name in names:
        base = (path.parent / Path(name).expanduser()).resolve()
        if not base.is_file():
            raise ConfigError(f"config {path}: _base_ file {str(name)!r} not found (looked for {base})")
        yield base


def _load_yaml(path: Path, text: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "'\\t'" in problem:  # YAML forbids tabs in indentation; the parser's words do not say so
            problem += ": YAML indents with spaces: replace the tab with spaces"
        raise ConfigError(f"config {path}{line}: {problem}") from None
    return _top_level(path, data)


def _load_json(path: Path, text: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config {path} line {e.lineno}: {e.msg}") from None
    return _top_level(path, data)


def _top_level(path: Path, data: Any) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    # As in Python files, top-level '_' names are helpers (e.g. YAML anchors), not config keys.
    return {k: v for k, v in data.items() if k == BASE_KEY or not str(k).startswith("_")}


def _parse_python(text: str, path: Path) -> ast.Module:
    try:
        return ast.parse(text, filename=str(path))
    except SyntaxError as e:
        text = (e.text or "").strip()
        shown = f": {text[:60]!r}" if text else ""
        raise ConfigError(f"config {path} line {e.lineno}: {e.msg}{shown}") from None


def _load_python(path: Path, tree: ast.Module, bases: Config) -> dict:
    namespace: dict[str, Any] = {
        "__file__": str(path),
        "__name__": "__memfit_config__",
        "__builtins__": builtins,
        BASE_KEY: bases,
    }
    # The config's folder is importable while it runs, so a config can import a sibling module.
    sys.path.insert(0, str(path.parent))
    try:
        definitions = _definition_names(tree)
        exec(compile(tree, str(path), "exec"), namespace)
    except ConfigError:
        raise
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        line = f" line {frames[-1].lineno}" if frames else ""
        message = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"config {path}{line}: {type(e).__name__}: {message}") from e
    finally:
        try:
            sys.path.remove(str(path.parent))
        except ValueError:  # the config removed it itself
            pass
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_")
        and name not in definitions
        and not isinstance(value, types.ModuleType)
    }


def _definition_names(tree: ast.Module) -> set[str]:
    """Names bound at module level only by ``import``, ``def`` or ``class`` (never assigned).

    These are the config file's own tooling, not config keys. A name that an assignment rebinds
    (``policy = partial(policy, ...)``) is the user's value and stays a key.
    """
    defined: set[str] = set()
    assigned: set[str] = set()
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            defined.update((a.asname or a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    defined.update(_star_names(node))
                else:
                    defined.add(alias.asname or alias.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.With):
                targets = [item.optional_vars for item in node.items]
            for target in targets:
                if target is not None:
                    assigned.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Expr):
            assigned.update(n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr))
    return defined - assigned


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at module level: the body, and the bodies of top-level if/try/with/for."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _star_names(node: ast.ImportFrom) -> set[str]:
    """The names ``from module import *`` binds (needs the module; a failure surfaces at exec)."""
    if node.level or node.module is None:
        return set()
    try:
        module = importlib.import_module(node.module)
    except Exception:
        return set()
    public = getattr(module, "__all__", None)
    return set(public) if public is not None else {n for n in vars(module) if not n.startswith("_")}
