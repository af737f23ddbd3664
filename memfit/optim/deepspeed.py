"""DeepSpeedOptimWrapper: the optimizer wrapper when a DeepSpeed engine owns backward and step.

DeepSpeed's engine scales, reduces (or reduce-scatters) and clips gradients and steps its (ZeRO)
optimizer itself, so this wrapper only tells it where an accumulation window ends and keeps
memfit's counting, so that logging, LR schedules and checkpoints agree with every other strategy.
The engine's own loss division is switched off (``scale_wrt_gas=False``): the wrapper divides by
the real window size, which is smaller in an epoch's last, incomplete window.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memfit.errors import ConfigError
from memfit.optim.wrapper import OptimWrapper
from memfit.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register()
class DeepSpeedOptimWrapper(OptimWrapper):
    """``optim_wrapper=dict(type='DeepSpeedOptimWrapper', optimizer=dict(type='AdamW', lr=1e-3))``.

    Only valid with ``strategy=dict(type='DeepSpeedStrategy', ...)``, which builds it (also from
    an ``OptimWrapper``/``AmpOptimWrapper`` config) and attaches the engine. ``accumulative_counts``
    becomes DeepSpeed's ``gradient_accumulation_steps`` and ``clip_grad.max_norm`` its
    ``gradient_clipping``; ``optimizer`` is the torch optimizer whose ``param_groups`` the LR
    schedulers change (DeepSpeed steps it inside its ZeRO optimizer).
    """

    def __init__(self, optimizer: Optimizer, accumulative_counts: int = 1, clip_grad: dict | None = None) -> None:
        super().__init__(optimizer, accumulative_counts, clip_grad)
        if self.clip_grad and self.clip_grad.get("norm_type", 2) not in (2, 2.0):
            raise ConfigError(f"optim_wrapper.clip_grad={clip_grad!r}: DeepSpeed clips by the L2 norm only "
                              "(norm_type=2)")
        self.engine: Any = None

    def bind(self, strategy: Any, device: torch.device) -> None:
        if type(strategy).__name__ != "DeepSpeedStrategy":
            raise ConfigError("optim_wrapper.type='DeepSpeedOptimWrapper' needs strategy=dict(type="
                              f"'DeepSpeedStrategy', ...), got {type(strategy).__name__}: use OptimWrapper or "
                              "AmpOptimWrapper with it")
        super().bind(strategy, device)

    def attach(self, engine: Any) -> None:
        """Called by DeepSpeedStrategy once ``deepspeed.initialize`` has built the engine."""
        self.engine = engine

    # -- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        """Nothing to enter: autocast runs inside the engine's forward (its ``torch_autocast``
        section) and DeepSpeed reduces gradients only at the boundary set in ``update_params``."""
        yield

    def update_params(self, loss: torch.Tensor, step_kwargs: dict | None = None,
                      zero_kwargs: dict | None = None) -> None:
        """Backward through the engine and call its step on every micro-step (DeepSpeed's contract);
        the engine updates the weights only where this wrapper marks the window's end."""
        if self.engine is None:
            raise RuntimeError("DeepSpeedOptimWrapper is not attached to an engine: build it through DeepSpeedStrategy")
        boundary = self.should_update()
        self.engine.set_gradient_accumulation_boundary(boundary)
        factor = self.loss_factor()
        self.backward(loss / factor if factor > 1 else loss)
        self.step(**(step_kwargs or {}))
        if boundary and self.clip_grad:
            norm = self.engine.get_global_grad_norm()
            self.grad_norm = None if norm is None else torch.as_tensor(float(norm))
        self.inner_count += 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def step(self, **kwargs: Any) -> None:
        self.engine.step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        """The engine clears (or re-partitions) gradients after its own step."""

    # -- state -------------------------------------------------------------------------------
    def log_scalars(self) -> dict[str, Any]:
        out = super().log_scalars()
        if self.engine is not None and (self.engine.fp16_enabled() or self.engine.bfloat16_enabled()):
            out["skipped_steps"] = torch.as_tensor(int(self.engine.skipped_steps))
        return out

    def state_dict(self) -> dict:
        """The wrapper's counting only: the optimizer's state is written by the engine (sharded)."""
        return {"inner_count": self.inner_count}

    def load_state_dict(self, state: dict) -> None:
        self.inner_count = state.get("inner_count", self.inner_count)
