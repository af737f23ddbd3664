"""One DistributedDataParallel per submodule: MMEngine's ``MMSeparateDistributedDataParallel``.

A GAN's custom ``train_step`` calls ``self.generator(...)`` and ``self.discriminator(...)`` and steps
each optimizer with its own loss; one DDP around the whole model would never see those calls, and
its reducer would wait for gradients of the submodule that was not stepped. As MMEngine's wrapper,
every direct child with trainable parameters gets its own DDP; unlike it, the children stay in
place with their calls routed through their DDP (:mod:`memfit.strategies.route`), so the model,
its ``train_step`` and its state-dict keys are the user's, and no wrapper ``train_step`` is needed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.errors import ConfigError
from memfit.strategies.route import route_forward


def wrap_separately(model: nn.Module, device_ids: list | None, ddp_kwargs: dict) -> dict[str, DistributedDataParallel]:
    """Wrap each direct child of ``model`` that has trainable parameters in its own DDP (``ddp_kwargs``:
    the strategy's DDP options) and route the child's calls through it while gradients are enabled.

    Returns the DDPs by child name. Trainable parameters held by ``model`` itself would be reduced by
    no DDP: they are refused."""
    own = [name for name, p in model.named_parameters(recurse=False) if p.requires_grad]
    if own:
        raise ConfigError(f"DDPStrategy(separate=True): the model holds trainable parameters {own} outside its "
                          "submodules, which no per-submodule DDP would reduce; move them into a submodule")
    ddps = {}
    for name, child in model.named_children():
        if any(p.requires_grad for p in child.parameters()):
            ddps[name] = DistributedDataParallel(child, device_ids=device_ids, **ddp_kwargs)
            route_forward(child, ddps[name], when=torch.is_grad_enabled)
    return ddps


def separate_no_sync(ddps: dict[str, DistributedDataParallel], module: nn.Module) -> contextlib.ExitStack:
    """``no_sync`` of the DDPs that ``module`` holds (the whole model: all of them, as MMEngine's wrapper),
    or of the one that holds ``module`` (a submodule of a child). ``optim_context(self.generator)``
    thus skips the generator's reduction only; the discriminator's DDP is left as it is."""
    inside = {id(m) for m in module.modules()}
    owned = [ddp for _, ddp in sorted(ddps.items()) if id(ddp.module) in inside]
    if not owned:
        owned = [ddp for _, ddp in sorted(ddps.items()) if any(m is module for m in ddp.module.modules())]
    stack = contextlib.ExitStack()
    for ddp in owned:
        stack.enter_context(ddp.no_sync())
    return stack


def check_several_optimizers(strategy: Any, world_size: int) -> None:
    """Several optimizers (an ``OptimWrapperDict``) run in one process, or under DDPStrategy with one DDP
    per submodule (switched on here unless ``separate=False`` was asked for); anything else is refused."""
    name = type(strategy).__name__
    ddp = hasattr(strategy, "separate")  # DDPStrategy's option (its module imports this one: no import back)
    if ddp and not strategy.zero and strategy.separate is not False:
        strategy.separate = True
        return
    if strategy.capabilities.one_device and world_size == 1:
        return
    if ddp:
        cause = "zero=True (ZeroRedundancyOptimizer takes one optimizer)" if strategy.zero else "separate=False"
        raise ConfigError(f"optim_wrapper with several optimizers (OptimWrapperDict) and DDPStrategy {cause}: use "
                          "strategy='ddp' (one DDP per submodule, as MMSeparateDistributedDataParallel)")
    raise ConfigError(f"optim_wrapper with several optimizers (OptimWrapperDict) runs under SingleDeviceStrategy "
                      f"or DDPStrategy (one DDP per submodule), not {name} at world size {world_size}: use "
                      "strategy='ddp'")
