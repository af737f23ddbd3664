"""``--cfg-options KEY=VALUE ...``: turn command-line overrides into a dotted-key dict.

Values are Python literals where they parse (``1``, ``1e-3``, ``[1, 2]``, ``(1, 2)``, ``'abc'``,
``True``, ``None``) plus the spellings a shell user types: ``true``/``false``/``none`` in any case,
``dict(x=1)``, bare words (``abc`` -> ``'abc'``), bracketed lists of bare words as in MMEngine's
memory-saving guide's ``efficient_conv_bn_eval="[backbone]"`` (-> ``['backbone']``, nested brackets too, and names with
digits such as ``[backbone.layers.0]``), and top-level commas (``1,2`` -> ``[1, 2]``). Anything else
stays the raw string. One level of quotes around the whole value is removed first, as MMEngine's
``DictAction`` does, so ``"[backbone]"`` is a list; quote twice (``"'[backbone]'"``) for the string.
"""

from __future__ import annotations

import ast
from typing import Any

from memfit.errors import ConfigError

_WORDS = {"true": True, "false": False, "none": None, "null": None}
_PAIRS = {"[": "]", "(": ")", "{": "}"}


def parse_cfg_options(items: list[str]) -> dict[str, Any]:
    """Parse ``['a.b=1', 'c=[x,y]', ...]`` into ``{'a.b': 1, 'c': ['x', 'y']}``.

    Keys stay dotted (``Config.merge_from_dict`` resolves them, list indices included); a later
    item overrides an earlier one with the same key. An item without ``=`` is a ConfigError.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--cfg-options item {item!r} is not KEY=VALUE: write e.g. optim_wrapper.optimizer.lr=0.01"
            )
        options[key] = parse_value(text)
    return options


def parse_value(text: str) -> Any:
    """Parse one ``--cfg-options`` value (see the module docstring for the rules)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            inner = ast.literal_eval(text)
        except (SyntaxError, ValueError):
            inner = None
        if isinstance(inner, str):  # the whole value is one quoted string: drop that one level
            text = inner.strip()
    return _parse(text)


def _parse(text: str) -> Any:
    text = text.strip()
    if not text:
        return ""
    try:
        value = _literal(ast.parse(text, mode="eval").body, text)
    except (SyntaxError, ValueError):
        pass
    else:
        # Python reads "1,2" as a tuple; the command line means a list unless it wrote the parentheses.
        if isinstance(value, tuple) and not _enclosed(text, "("):
            return list(value)
        return value
    # Not Python (e.g. "[backbone.layers.0]"): split brackets and commas by hand.
    if _enclosed(text, "["):
        return [_parse(part) for part in _split(text[1:-1])]
    if _enclosed(text, "("):
        return tuple(_parse(part) for part in _split(text[1:-1]))
    parts = _split(text)
    if len(parts) > 1:
        return [_parse(part) for part in parts]
    return _number(text)  # e.g. 007, which Python does not read but int() does


def _literal(node: ast.expr, source: str) -> Any:
    """``ast.literal_eval`` plus bare words as strings, true/false/none and ``dict(key=value)``; numbers
    only as MMEngine's ``DictAction`` reads them (``int()``/``float()``: ``0x10``, ``0o7``, ``1j`` stay strings,
    so a shape such as ``0x0`` is not read as the hexadecimal 0)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float, complex)) and not isinstance(node.value, bool):
            return _number(ast.get_source_segment(source, node) or "")
        return node.value
    if isinstance(node, ast.Name):
        return _WORDS.get(node.id.lower(), node.id)
    if isinstance(node, ast.Attribute):  # a dotted bare word such as backbone.layers
        if all(isinstance(n, (ast.Name, ast.Attribute, ast.Load)) for n in ast.walk(node)):
            return ast.unparse(node)
        return _fail()
    if isinstance(node, ast.List):
        return [_literal(e, source) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e, source) for e in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            _fail()
        return {_literal(k, source): _literal(v, source) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand, source)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and not node.args
        and all(kw.arg is not None for kw in node.keywords)
    ):
        return {kw.arg: _literal(kw.value, source) for kw in node.keywords}
    return _fail()


def _number(spelling: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(spelling)
        except ValueError:
            pass
    return spelling


def _fail() -> Any:
    raise ValueError("not a literal")


def _enclosed(text: str, opener: str) -> bool:
    """True if ``text`` starts with ``opener`` and that bracket closes at the very end."""
    if not text.startswith(opener) or not text.endswith(_PAIRS[opener]):
        return False
    depth = 0
    for i, ch in enumerate(text):
        if ch in _PAIRS:
            depth += 1
        elif ch in _PAIRS.values():
            depth -= 1
            if depth == 0:
                return i == len(text) - 1
    return False


def _split(text: str) -> list[str]:
    """Split at commas outside brackets and quotes; a trailing comma adds no element."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _PAIRS:
            depth += 1
        elif ch in _PAIRS.values():
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if len(parts) > 1 and not parts[-1].strip():
        parts.pop()
    return [p.strip() for p in parts] if any(p.strip() for p in parts) else []
