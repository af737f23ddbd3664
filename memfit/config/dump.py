"""Write a resolved config to a ``.py`` or ``.yaml`` file that ``Config.fromfile`` reads back.

The Python form keeps classes and functions: each becomes an import line plus its name
(``from torch.optim import SGD`` ... ``type=SGD``), and ``functools.partial``, ``torch.dtype``,
``torch.device`` and enum members are written as the expressions that rebuild them. YAML cannot
hold code, so there a class or function is written as its import path string. A value that cannot
be written at all (a live DataLoader, nn.Module, tensor, a class defined in ``__main__``) becomes the
string ``'<not serialisable: TypeName>'`` with a comment, so dumping never fails: the file is a
record of the run, and the live objects came from Python code that the record cannot contain.
"""

from __future__ import annotations

import builtins
import enum
import functools
import importlib
import keyword
import math
import numbers
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import yaml

from memfit.config.loader import PYTHON_SUFFIXES, YAML_SUFFIXES
from memfit.errors import ConfigError

PLACEHOLDER = "<not serialisable: {}>"
_LINE_WIDTH = 100
_INDENT = "    "


def dump_config(cfg: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``cfg`` to ``path`` (``.py``, ``.yaml`` or ``.yml``) atomically and return the path.

    The write goes to a temporary file in the same folder and is renamed into place, so a crash
    never leaves a half-written config where a previous one stood.
    """
    path = Path(path)
    if path.suffix in PYTHON_SUFFIXES:
        text = config_to_python(cfg)
    elif path.suffix in YAML_SUFFIXES:
        text = config_to_yaml(cfg)
    else:
        raise ConfigError(f"cannot dump a config to {str(path)!r}: use a .py, .yaml or .yml file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def config_to_python(cfg: Mapping[str, Any]) -> str:
    """The text of a Python config file equal to ``cfg`` (see the module docstring)."""
    return _PythonWriter(cfg).write()


def config_to_yaml(cfg: Mapping[str, Any]) -> str:
    """The text of a YAML config file equal to ``cfg`` where YAML can hold the values."""
    data = {str(k): _yaml_value(v, set()) for k, v in cfg.items()}
    text = yaml.safe_dump(
        data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=_LINE_WIDTH
    )
    marker = PLACEHOLDER.split("{")[0]
    lines = [
        f"{line}  # not serialisable: not written" if marker in line else line for line in text.splitlines()
    ]
    return "# Resolved config written by memfit.\n" + "\n".join(lines) + "\n"


# -- shared: how to name an importable object ------------------------------------------------------
def import_path(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` to import ``obj`` from, preferring the shortest public module.

    ``torch.optim.sgd.SGD`` is found as ``('torch.optim', 'SGD')``. Objects defined in ``__main__``,
    inside functions, or in a module that cannot be imported have no import path (None).
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if (
        not isinstance(module, str)
        or not isinstance(qualname, str)
        or "<" in qualname
        or module == "__main__"
    ):
        return None
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if any(p.startswith("_") for p in parts[:i]) and i < len(parts):
            continue  # don't route through a private package when a longer public path may exist
        mod = sys.modules.get(prefix)
        if mod is None and prefix == module:
            try:
                mod = importlib.import_module(module)
            except Exception:
                return None
        if mod is not None and _resolve(mod, qualname) is obj:
            return prefix, qualname
    return None


def _resolve(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _is_code(value: Any) -> bool:
    """Classes and functions: written by reference, never as their contents."""
    return isinstance(value, type) or (
        callable(value) and hasattr(value, "__qualname__") and hasattr(value, "__module__")
    )


def _placeholder(value: Any) -> str:
    """``'<not serialisable: DataLoader>'``; a class or function is named itself, not ``type``."""
    name = getattr(value, "__name__", None) if _is_code(value) else None
    return PLACEHOLDER.format(name or type(value).__name__)


def _number(value: Any) -> Any:
    """Python int/float for numpy and other numeric scalars; None if ``value`` is not one."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


# -- YAML ------------------------------------------------------------------------------------------
def _yaml_value(value: Any, active: set[int]) -> Any:
    if value is None or isinstance(value, str) and not isinstance(value, enum.Enum):
        return None if value is None else str(value)
    number = _number(value)
    if number is not None:
        return number
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        if id(value) in active:
            return PLACEHOLDER.format("recursive " + type(value).__name__)
        active = active | {id(value)}
        if isinstance(value, Mapping):
            return {
                k if isinstance(k, (str, int, float, bool)) else str(k): _yaml_value(v, active)
                for k, v in value.items()
            }
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_yaml_value(v, active) for v in items]
    if isinstance(value, enum.Enum):
        where = import_path(type(value))
        return f"{where[0]}.{where[1]}.{value.name}" if where else _placeholder(value)
    if _is_torch(value, "dtype"):
        return str(value)
    if _is_torch(value, "device"):
        return str(value)
    if _is_code(value):
        where = import_path(value)
        return f"{where[0]}.{where[1]}" if where else _placeholder(value)
    return _placeholder(value)


def _is_torch(value: Any, type_name: str) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == type_name


# -- Python ----------------------------------------------------------------------------------------
class _Leaf(str):
    """Rendered text of a value that must carry a comment at the end of its line."""

    comment: str


class _PythonWriter:
    """Renders values as Python expressions and collects the imports they need."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.top_keys = {k for k in cfg if isinstance(k, str)}
        # Written as dict(...) unless the config itself rebinds the name `dict` at top level.
        self.dict_calls = "dict" not in self.top_keys
        self.imports: dict[tuple[str, str], str] = {}  # (module, top name) -> local alias
        self.taken = set(self.top_keys) | {"dict"}

    def write(self) -> str:
        body = []
        for key, value in self.cfg.items():
            text = self.render(value, 0, len(str(key)) + 3)
            if isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
                line = f"{key} = {text}"
            else:  # not a Python name (e.g. from YAML): still a top-level name of the namespace
                line = f"globals()[{key!r}] = {text}"
            body.append(line + (f"  {text.comment}" if isinstance(text, _Leaf) else ""))
        head = ["# Resolved config written by memfit; load it with memfit.config.Config.fromfile."]
        for module in sorted({m for m, _ in self.imports}):
            names = sorted((n, a) for (m, n), a in self.imports.items() if m == module)
            head.append(
                f"from {module} import " + ", ".join(n if n == a else f"{n} as {a}" for n, a in names)
            )
        return "\n".join(head) + "\n\n" + "\n".join(body) + "\n"

    # -- references to code ----------------------------------------------------------------------
    def reference(self, obj: Any) -> str | None:
        """A name for ``obj`` in the written file (adding its import), or None if it has none."""
        name = getattr(obj, "__qualname__", None)
        if getattr(obj, "__module__", None) == "builtins" and getattr(builtins, str(name), None) is obj:
            if name not in self.top_keys:  # else: imported from builtins under another name
                return str(name)
        where = import_path(obj)
        if where is None:
            return None
        module, qualname = where
        head, _, rest = qualname.partition(".")
        alias = self.imports.get((module, head))
        if alias is None:
            alias, n = head, 1
            while alias in self.taken:  # a top-level key or another import already uses the name
                n += 1
                alias = f"{head}_{n}"
            self.imports[(module, head)] = alias
            self.taken.add(alias)
        return f"{alias}.{rest}" if rest else alias

    # -- values ----------------------------------------------------------------------------------
    def render(self, value: Any, depth: int, used: int, active: frozenset[int] = frozenset()) -> str:
        """Render ``value`` at nesting ``depth``; ``used`` columns precede it on its first line."""
        if isinstance(value, (Mapping, list, tuple, set, frozenset)) and not isinstance(value, (str, bytes)):
            if id(value) in active:
                return self.leaf(
                    PLACEHOLDER.format("recursive " + type(value).__name__), "# refers to itself"
                )
            return self.container(value, depth, used, active | {id(value)})
        return self.scalar(value)

    def leaf(self, text: str, comment: str) -> _Leaf:
        out = _Leaf(repr(text))
        out.comment = comment
        return out

    def scalar(self, value: Any) -> str:
        if value is None or isinstance(value, bool):
            return repr(value)
        if isinstance(value, enum.Enum):
            owner = self.reference(type(value))
            return f"{owner}.{value.name}" if owner else self.unwritable(value)
        if isinstance(value, (str, bytes)):
            return repr(str(value) if isinstance(value, str) else bytes(value))
        number = _number(value)
        if isinstance(number, float) and not math.isfinite(number):
            return f"float({str(number)!r})"
        if number is not None:
            return repr(number)
        if isinstance(value, complex):
            return repr(value)
        if isinstance(value, PurePath):
            return repr(str(value))
        if _is_torch(value, "dtype"):  # a dtype has no constructor: import it by name (torch.bfloat16)
            name = str(value).split(".")[-1]
            return self.reference_from("torch", name, value) or self.unwritable(value)
        if _is_torch(value, "device"):
            owner = self.reference(type(value))
            return f"{owner}({str(value)!r})" if owner else self.unwritable(value)
        if isinstance(value, functools.partial):
            return self.partial(value)
        if _is_code(value):
            return self.reference(value) or self.unwritable(value)
        return self.unwritable(value)

    def reference_from(self, module: str, name: str, obj: Any) -> str | None:
        """Import ``name`` from ``module`` for an object without a ``__qualname__`` (a dtype)."""
        if getattr(sys.modules.get(module), name, None) is not obj:
            return None
        alias = self.imports.get((module, name))
        if alias is None:
            alias, n = name, 1
            while alias in self.taken:
                n += 1
                alias = f"{name}_{n}"
            self.imports[(module, name)] = alias
            self.taken.add(alias)
        return alias

    def partial(self, value: functools.partial) -> str:
        func = self.reference(value.func)
        parts = [self.render(a, 0, 0) for a in value.args]
        parts += [f"{k}={self.render(v, 0, 0)}" for k, v in value.keywords.items()]
        if func is None or any(isinstance(p, _Leaf) or "\n" in p for p in parts):
            return self.unwritable(value)
        return f"{self.reference(functools.partial)}({', '.join([func, *parts])})"

    def unwritable(self, value: Any) -> _Leaf:
        kind = type(value)
        what = (
            f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
        )
        if _is_code(value):
            where = getattr(value, "__module__", "?")
            return self.leaf(
                _placeholder(value),
                f"# {getattr(value, '__qualname__', value)!s} from {where} is not importable",
            )
        return self.leaf(_placeholder(value), f"# a live {what} object: not written")

    def container(self, value: Any, depth: int, used: int, active: frozenset[int]) -> str:
        if isinstance(value, Mapping):
            keyword_form = self.dict_calls and all(
                isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in value
            )
            items = [(f"{k}=" if keyword_form else f"{self.scalar(k)}: ", v) for k, v in value.items()]
            open_, close = ("dict(", ")") if keyword_form else ("{", "}")
        elif isinstance(value, (set, frozenset)):
            items = [("", v) for v in sorted(value, key=repr)]
            if not items:
                return "frozenset()" if isinstance(value, frozenset) else "set()"
            open_, close = ("frozenset({", "})") if isinstance(value, frozenset) else ("{", "}")
        else:
            items = [("", v) for v in value]
            open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        # Each item sits on its own line after its prefix and before a comma if the container breaks.
        rendered = [(prefix, self.render(v, depth + 1, len(prefix) + 1, active)) for prefix, v in items]
        flat = all(not isinstance(t, _Leaf) and "\n" not in t for _, t in rendered)
        if flat:
            inner = ", ".join(p + t for p, t in rendered)
            if isinstance(value, tuple) and len(rendered) == 1:
                inner += ","
            if used + len(_INDENT) * depth + len(open_ + inner + close) <= _LINE_WIDTH:
                return open_ + inner + close
        pad = _INDENT * (depth + 1)
        lines = [open_]
        for prefix, text in rendered:
            comment = f"  {text.comment}" if isinstance(text, _Leaf) else ""
            lines.append(f"{pad}{prefix}{text},{comment}")
        lines.append(_INDENT * depth + close)
        return "\n".join(lines)
