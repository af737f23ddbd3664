"""The memfit logger and the message hub (scalar history shared by hooks)."""

from __future__ import annotations

import logging
import sys
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import torch

from memfit.dist import get_rank
from memfit.errors import ConfigError, mark_failure, nearest

LOGGER_NAME = "memfit"
_FORMAT = "%(asctime)s - memfit - %(levelname)s - %(message)s"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (test capture, redirection)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_level(level: Any, key: str = "log_level") -> None:
    """A level name logging knows (as MMEngine's ``log_level``) or a number; else one line naming ``key``."""
    if isinstance(level, int) and not isinstance(level, bool):
        return
    if not isinstance(level, str) or level not in LEVELS:
        close = nearest(level.upper(), LEVELS) if isinstance(level, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={level!r}: use one of {', '.join(LEVELS)}{hint}")


def get_logger(log_file: str | Path | None = None, level: str | int = "INFO") -> logging.Logger:
    """The 'memfit' logger: console on rank 0 (warnings and errors on every rank), optional file."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(_FORMAT, datefmt="%m/%d %H:%M:%S")
    if not any(getattr(h, "_memfit_console", False) for h in logger.handlers):
        console = _StdoutHandler()
        console._memfit_console = True  # type: ignore[attr-defined]
        console.setFormatter(fmt)
        console.setLevel(level if get_rank() == 0 else logging.WARNING)
        logger.addHandler(console)
    if log_file is not None:
        for h in list(logger.handlers):
            if getattr(h, "_memfit_file", False):
                logger.removeHandler(h)
                h.close()
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh._memfit_file = True  # type: ignore[attr-defined]
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    return logger


def log_failure(logger: logging.Logger, exc: BaseException, what: str, where: str = "") -> None:
    """Log one line saying where ``what`` (training, val, test) stopped and why, on the console and
    in the log file, and the full traceback in the log file only (the CLI prints it with ``--debug``).

    The exception itself is left to propagate unchanged, with that line as a note and the log
    file's path on it (:func:`memfit.errors.mark_failure`; the CLI reads them back). A
    KeyboardInterrupt or SystemExit gets a warning line only.
    """
    where = f" {where}" if where else ""
    if not isinstance(exc, Exception):
        logger.warning(f"{what} interrupted{where} ({type(exc).__name__})")
        return
    files = [h for h in logger.handlers if getattr(h, "_memfit_file", False)]
    log_file = files[0].baseFilename if files else None
    logger.error(mark_failure(exc, f"{what} failed{where}", log_file))
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "traceback of the failure above:", None,
                               (type(exc), exc, exc.__traceback__))
    for handler in files:
        handler.handle(record)


class MessageHub:
    """Scalar histories (``train/loss`` ...) and runtime info shared between hooks and loops.

    Values may be tensors: they are converted to floats only when read (``mean``/``latest``), so
    the training step itself never forces a host sync.
    """

    def __init__(self, window: int = 1000) -> None:
        self._scalars: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))
        self.runtime_info: dict[str, Any] = {}

    def update_scalar(self, key: str, value: float | torch.Tensor, count: int = 1) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self._scalars[key].append((value, count))

    def update_scalars(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.update_scalar(k, v)

    def mean(self, key: str, window: int | None = None) -> float:
        items = list(self._scalars[key])[-window:] if window else list(self._scalars[key])
        total = sum(_to_float(v) * c for v, c in items)
        n = sum(c for _, c in items)
        return total / max(n, 1)

    def latest(self, key: str) -> float:
        return _to_float(self._scalars[key][-1][0])

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self._scalars if k.startswith(prefix) and self._scalars[k]]

    def update_info(self, key: str, value: Any) -> None:
        self.runtime_info[key] = value

    def get_info(self, key: str, default: Any = None) -> Any:
        return self.runtime_info.get(key, default)

    def state_dict(self) -> dict:
        """Runtime info only (best metric etc.); plain data for the checkpoint."""
        return {"runtime_info": dict(self.runtime_info)}

    def load_state_dict(self, state: dict) -> None:
        self.runtime_info.update(state.get("runtime_info", {}))


def _to_float(v: Any) -> float:
    return float(v.float().mean()) if isinstance(v, torch.Tensor) else float(v)
