"""An optimizer's step alone, on fake parameters with gradients: the operators a host runs where a row's optimizer
steps there (FSDP's CPU offload, optimizer offload).

Such a row's memory comes from the fake step of the same row on the device with a fused optimizer
(:meth:`memfit.planner.composer.Composer._shard`): the two differ only in the optimizer's temporaries, which are the
host's. The host runs the row's own optimizer (foreach, or torch's loop over tensors), whose operators set its cost
(:func:`memfit.planner.cost.step_time`); this counts them without a forward/backward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.planner.fake import Phase, StepMeasurement, _materialise, measured_optim_wrapper
from memfit.planner.op_counter import OpCounter


def optimizer_step(cfg: dict, meta_model: nn.Module) -> StepMeasurement:
    """One step of ``cfg``'s optimizer (its offload included) over the model's parameters, each with a gradient, in
    one process: a measurement whose ``step_ops`` are the step's operators (nothing else is measured)."""
    from memfit.connector import setup
    from memfit.measure import MemoryTracker
    from memfit.planner.space import technique_cfg
    from memfit.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy()
    strategy.setup_env("none")
    strategy.device = torch.device("cpu")
    techniques = {k: v for k, v in technique_cfg(cfg).items() if k == "optimizer_offload"}
    optim_cfg = measured_optim_wrapper(copy.deepcopy(cfg["optim_wrapper"]), full=True)
    model = copy.deepcopy(meta_model)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = _materialise(model, mode)
        model, wrapper = setup(model, strategy, optim_cfg, techniques,
                               optimizer_offload=bool(techniques.get("optimizer_offload")))
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        counter = OpCounter()
        with counter, MemoryTracker(model, wrapper.optimizer, observer=counter):
            wrapper.optimizer.step()
    return StepMeasurement(0, {}, Phase(), Phase(), step_ops=counter.step_ops)


__all__ = ["optimizer_step"]
