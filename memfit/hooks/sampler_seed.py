"""DistSamplerSeedHook: gives the train sampler its epoch, so every epoch is shuffled anew."""

from __future__ import annotations

from typing import Any

from memfit.hooks.base import Hook
from memfit.registry import HOOKS


@HOOKS.register()
class DistSamplerSeedHook(Hook):
    """Calls ``set_epoch(runner.epoch)`` on the train loader's sampler (or batch sampler's sampler)."""

    def before_train_epoch(self, runner: Any) -> None:
        loader = runner.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if not hasattr(sampler, "set_epoch"):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(runner.epoch)
