"""References from a config to its ``_base_`` configs, as MMEngine's ``Config`` resolves them.

``{{_base_.name}}`` (any format, a dotted path into the merged bases) stands for that value: the text is
loaded with a placeholder string in its place, which is then replaced by a copy of the value. In a Python
config, ``_base_`` itself is the merged bases while the file runs (``_base_.model.backbone.depth``), so the
file's ``_base_ = [...]`` is read from its syntax tree before it runs, as MMEngine reads it.
"""

from __future__ import annotations

import ast
import copy
import re
import uuid
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

BASE_KEY = "_base_"
_REF = re.compile(r"\{\{\s*" + BASE_KEY + r"\.([\w.]+)\s*\}\}")


def hold_refs(text: str) -> tuple[str, dict[str, str]]:
    """``text`` with each ``{{_base_.name}}`` replaced by a quoted placeholder; the placeholders' names."""
    held: dict[str, str] = {}
    for name in sorted(set(_REF.findall(text))):
        holder = f"_memfit_base_{name}_{uuid.uuid4().hex[:8]}"
        held[holder] = name
        text = re.sub(r"\{\{\s*" + BASE_KEY + r"\." + re.escape(name) + r"\s*\}\}", f'"{holder}"', text)
    return text, held


def fill_refs(value: Any, held: dict[str, str], bases: dict, path: Path) -> Any:
    """``value`` with every placeholder of :func:`hold_refs` replaced by a copy of the bases' value."""
    if not held:
        return value
    if isinstance(value, dict):
        return {k: fill_refs(v, held, bases, path) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(fill_refs(v, held, bases, path) for v in value)
    if isinstance(value, str):
        if value in held:
            return copy.deepcopy(_lookup(bases, held[value], path))
        for holder, name in held.items():
            if holder in value:
                raise ConfigError(f"config {path}: {{{{_base_.{name}}}}} must stand as a whole value, not inside "
                                  f"a larger expression (in a Python config, write _base_.{name} there)")
    return value


def _lookup(bases: dict, name: str, path: Path) -> Any:
    value: Any = bases
    for i, part in enumerate(name.split(".")):
        if not isinstance(value, dict) or part not in value:
            where = "_base_." + ".".join(name.split(".")[:i]) if i else "the _base_ configs"
            raise ConfigError(f"config {path}: {{{{_base_.{name}}}}}: no key {part!r} in {where}")
        value = value[part]
    return value


def python_bases(tree: ast.Module, path: Path) -> tuple[ast.Module, Any]:
    """The file's tree without its top-level ``_base_ = ...`` assignments, and the value of the first (None
    if it has none): a literal expression, evaluated on its own, as MMEngine does."""
    spec, body = None, []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == BASE_KEY for t in node.targets):
            if spec is None:
                try:
                    spec = eval(compile(ast.Expression(node.value), str(path), "eval"), {"__builtins__": {}})
                except Exception as exc:  # noqa: BLE001 - any error: the value is not a file list
                    raise ConfigError(f"config {path} line {node.lineno}: _base_ must be a file name or a list "
                                      f"of file names written out, not computed ({type(exc).__name__}: "
                                      f"{exc})") from None
            continue
        body.append(node)
    return ast.Module(body=body, type_ignores=tree.type_ignores), spec
