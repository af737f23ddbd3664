"""Parameter schedulers with MMEngine's ``begin``/``end``/``by_epoch`` on top of torch's.

Each torch LR scheduler is wrapped so it only steps inside ``[begin, end)``, counted in epochs or
iterations. ``convert_to_iter_based=True`` turns an epoch-based schedule into a per-iteration one
(smooth warm-up). Several schedulers may be listed: torch's chainable form composes them.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.optim import Optimizer

from memfit.errors import ConfigError
from memfit.registry import PARAM_SCHEDULERS

# MMEngine names that torch spells differently.
_ALIASES = {"PolyLR": "PolynomialLR"}
# How a scheduler's length is called in torch, filled from end - begin when not given.
_LENGTH_ARG = {"LinearLR": "total_iters", "ConstantLR": "total_iters", "PolynomialLR": "total_iters",
               "CosineAnnealingLR": "T_max", "OneCycleLR": "total_steps"}


class ParamScheduler:
    """A torch scheduler active on ``[begin, end)``; stepped per epoch or per iteration."""

    def __init__(self, scheduler: Any, begin: int, end: int, by_epoch: bool) -> None:
        self.scheduler = scheduler
        self.begin, self.end, self.by_epoch = begin, end, by_epoch
        self.steps = 0  # how many times it has been stepped (the position it resumes from)

    def step_at(self, position: int) -> None:
        """Called after an epoch/iteration ``position`` (0-based) finished."""
        if self.begin <= position < self.end:
            self.scheduler.step()
            self.steps += 1

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]


def build_param_schedulers(
    cfg: Any, optimizer: Optimizer, *, by_epoch_run: bool, max_epochs: int | None, max_iters: int, iters_per_epoch: int
) -> list[ParamScheduler]:
    """Build the ``param_scheduler`` config (a dict or a list of dicts) for ``optimizer``."""
    if cfg is None:
        return []
    items = cfg if isinstance(cfg, list) else [cfg]
    out = []
    for i, item in enumerate(items):
        key = f"param_scheduler[{i}]" if isinstance(cfg, list) else "param_scheduler"
        if not isinstance(item, dict):
            raise ConfigError(f"{key}: expected a dict with 'type', got {type(item).__name__}")
        item = dict(item)
        kind = item.pop("type", None)
        if kind is None:
            raise ConfigError(f"{key}: missing 'type' (e.g. 'LinearLR', 'CosineAnnealingLR', 'MultiStepLR')")
        name = _ALIASES.get(kind, kind) if isinstance(kind, str) else kind.__name__
        cls = PARAM_SCHEDULERS.get(name, key) if isinstance(kind, str) else kind
        by_epoch = item.pop("by_epoch", by_epoch_run)
        convert = item.pop("convert_to_iter_based", False)
        begin = item.pop("begin", 0)
        total = (max_epochs if by_epoch and max_epochs else max_iters)
        end = item.pop("end", None)
        for arg, value in (("begin", begin), ("end", end)):
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"{key}.{arg}={value!r}: use an int >= 0 ({'epochs' if by_epoch else 'iterations'})")
        end = total if end is None or end > 10**8 else end
        if end <= begin:
            raise ConfigError(f"{key}: end={end} is not after begin={begin}: the scheduler would never step")
        if by_epoch and convert:
            begin, end, by_epoch = begin * iters_per_epoch, end * iters_per_epoch, False
            for arg in ("total_iters", "T_max", "step_size", "total_steps"):
                if arg in item:
                    item[arg] = item[arg] * iters_per_epoch
            if "milestones" in item:
                item["milestones"] = [m * iters_per_epoch for m in item["milestones"]]
        length_arg = _LENGTH_ARG.get(name)
        if length_arg and length_arg not in item:
            item[length_arg] = end - begin
        params = inspect.signature(cls).parameters
        if "optimizer" not in params:
            raise ConfigError(f"{key}: {name} is not an optimizer scheduler")
        # The registry turns the constructor's errors into ``<key>: <cause> (<name>)``.
        sched = PARAM_SCHEDULERS.build({"type": cls, **item}, key=key, optimizer=optimizer)
        out.append(ParamScheduler(sched, begin, end, by_epoch))
    return out
