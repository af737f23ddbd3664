"""Scheduler state in a checkpoint: saving and restoring a run's schedulers (a list, or a dict of
lists with several optimizers) as plain data that loads with ``weights_only=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import CheckpointError


def scheduler_state(param_schedulers: list | dict) -> list | dict:
    """Each scheduler's ``state_dict()``, in the shape of ``runner.param_schedulers``."""
    if isinstance(param_schedulers, dict):
        return {name: scheduler_state(s) for name, s in param_schedulers.items()}
    return [s.state_dict() if hasattr(s, "state_dict") else {} for s in param_schedulers]


def _flat(param_schedulers: list | dict) -> list:
    return [s for v in param_schedulers.values() for s in v] if isinstance(param_schedulers, dict) \
        else list(param_schedulers)


def load_scheduler_state(runner: Any, state: dict, path: str | Path) -> None:
    """Restore ``runner.param_schedulers`` from a checkpoint's ``state``; a mismatch with the config
    is a one-line CheckpointError naming ``path``."""
    own = runner.param_schedulers
    if "param_schedulers" not in state:
        if _flat(own):
            runner.logger.warning(f"{path}: holds no scheduler state (saved with save_param_scheduler=False): "
                                  "the param schedulers start afresh")
        return
    saved = state["param_schedulers"]
    if isinstance(own, dict) != isinstance(saved, dict) or (isinstance(own, dict) and set(own) != set(saved)):
        shape = sorted(saved) if isinstance(saved, dict) else "one optimizer"
        raise CheckpointError(f"{path}: holds the param schedulers of {shape}, the config builds "
                              f"{sorted(own) if isinstance(own, dict) else 'one optimizer'}: resume with the "
                              "same optim_wrapper and param_scheduler")
    pairs = [(n, own[n], saved[n]) for n in own] if isinstance(own, dict) else [(None, own, saved)]
    for name, mine, theirs in pairs:
        if len(theirs) != len(mine):
            where = f" for optimizer {name!r}" if name is not None else ""
            raise CheckpointError(f"{path}: holds {len(theirs)} param schedulers{where}, the config has {len(mine)}: "
                                  "resume with the same param_scheduler list")
        for sched, s in zip(mine, theirs):
            if set(s) == {"scheduler", "steps"}:
                raise CheckpointError(f"{path}: scheduler state of an older memfit (torch-wrapped schedulers) that "
                                      "MMEngine's schedulers cannot continue: start from the weights with load_from")
            if hasattr(sched, "load_state_dict"):  # any object with step() may be a scheduler
                sched.load_state_dict(s)
    it = (state.get("loop") or {}).get("iter", 0)
    length = getattr(runner.train_loop, "iters_per_epoch", 0)
    if length and it % length and any(getattr(s, "by_epoch", False) for s in _flat(own)):
        runner.logger.warning(f"{path}: resumed at iteration {it}, {it % length} iterations into an epoch of {length}: "
                              "the epoch-based param schedulers keep this epoch's value until it ends")
