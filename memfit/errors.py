"""Error types and the nearest-name suggestion used by every one-line error."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable


class MemfitError(Exception):
    """Base class: a user-facing error whose message names the cause and the fix."""


class ConfigError(MemfitError, ValueError):
    """A config key or value is wrong: the message names the key and a valid alternative."""


class ConfigTypeError(ConfigError, TypeError):
    """A config value has the wrong type (MMEngine raises TypeError there): caught by ``except TypeError``,
    ``except ValueError`` and ``except ConfigError`` alike."""


class CheckpointError(MemfitError, RuntimeError):
    """A checkpoint file is missing, corrupt, unsafe or does not fit the model/config."""


class TrainingError(MemfitError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the message names the iteration and the fix."""


# ``memfit train``'s exit status after a preemption checkpoint: sysexits.h's EX_TEMPFAIL ("temporary
# failure, the user is invited to retry"), which a Slurm script tests to requeue the job.
PREEMPTED_EXIT_CODE = 75


class Preempted(MemfitError):
    """Training stopped on a preemption signal after saving a checkpoint that resumes at the next batch.

    Raised by ``Runner.train()`` once the checkpoint is complete; ``memfit train`` prints its message
    in one line and exits with :data:`PREEMPTED_EXIT_CODE`. ``signal_name`` ('SIGTERM', 'SIGUSR1'),
    ``iteration`` (iterations completed) and ``checkpoint`` (its path) say what happened.
    """

    def __init__(self, message: str, signal_name: str = "", iteration: int = 0, checkpoint: str = "") -> None:
        super().__init__(message)
        self.signal_name, self.iteration, self.checkpoint = signal_name, iteration, checkpoint


def first_line(exc: BaseException, limit: int = 240) -> str:
    """The first non-empty line of ``exc``'s message (its type name when it has none), shortened to
    ``limit`` characters, for a one-line error that quotes another library's exception."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def component_error(where: str, component: str, exc: BaseException) -> ConfigError:
    """``<where>: <first line of exc> (<component>)``: an exception a constructor raised while a
    component was built from its config (``optim_wrapper.optimizer: invalid learning rate: -1 (SGD)``).
    A ConfigTypeError when ``exc`` is a TypeError, so ``except TypeError`` still catches it. The caller
    raises it ``from exc`` so the original stays the ``__cause__``."""
    text = first_line(exc)
    word = text.split(" ", 1)[0]
    if word[:1].isupper() and word[1:].islower():  # 'Invalid learning rate' -> 'invalid ...', not 'CUDA'
        text = text[0].lower() + text[1:]
    return type_or_value_error(f"{where}: {text} ({component})", isinstance(exc, TypeError))


def type_or_value_error(message: str, wrong_type: bool) -> ConfigError:
    """The error of a check of both a value's type and its range, with one message: ConfigTypeError when
    the type is wrong (where MMEngine raises TypeError), ConfigError (a ValueError) otherwise."""
    return (ConfigTypeError if wrong_type else ConfigError)(message)


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


_WARNED: set[str] = set()


def warn_ignored(option: str, reason: str) -> None:
    """Log once per process, on the 'memfit' logger, that ``option`` has no effect and why.

    For options accepted from MMEngine/FSDP1/DeepSpeed configs that memfit cannot honour: the
    message names the option and what to use instead, so nothing is dropped silently. Repeats
    (an object built twice, every epoch's sampler) are not logged again.
    """
    if option in _WARNED:
        return
    _WARNED.add(option)
    logging.getLogger("memfit").warning(f"{option} has no effect in memfit: {reason}")


def mark_failure(exc: BaseException, where: str, log_file: object = None) -> str:
    """Record on ``exc`` where a run failed (``training failed at epoch 2, iteration 37``) and return
    the one-line summary ``<where>: <what>``; it is also added as a note, so a traceback shows it.
    ``log_file``: where the full traceback was written (the CLI names it)."""
    what = str(exc).strip() if isinstance(exc, MemfitError) else f"{type(exc).__name__}: {first_line(exc)}"
    summary = f"{where}: {what}"
    try:
        exc.memfit_failure = summary  # type: ignore[attr-defined]
        exc.memfit_log_file = log_file  # type: ignore[attr-defined]
        if hasattr(exc, "add_note"):  # Python >= 3.11: a printed traceback ends with the line
            exc.add_note(summary)
    except (AttributeError, TypeError):  # an exception type that takes no attributes: the log has it
        pass
    return summary


def failure_summary(exc: BaseException) -> str | None:
    """The summary :func:`mark_failure` recorded on ``exc`` (None: it did not fail inside a run)."""
    return getattr(exc, "memfit_failure", None)
