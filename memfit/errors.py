"""Error types and the nearest-name suggestion used by every one-line error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MemfitError(Exception):
    """Base class: a user-facing error whose message names the cause and the fix."""


class ConfigError(MemfitError, ValueError):
    """A config key or value is wrong: the message names the key and a valid alternative."""


class CheckpointError(MemfitError, RuntimeError):
    """A checkpoint file is missing, corrupt, unsafe or does not fit the model/config."""


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Return up to ``n`` candidates closest to ``name`` (case-insensitive)."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    return [lowered[h] for h in hits]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ``did you mean ...?`` tail for an error message, or a list of valid names."""
    candidates = sorted(set(candidates))
    close = nearest(name, candidates)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    shown = ", ".join(candidates[:12]) + (", ..." if len(candidates) > 12 else "")
    return f"valid names: {shown}"
