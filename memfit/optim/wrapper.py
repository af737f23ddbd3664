"""Optimizer wrappers: accumulation, clipping and mixed precision around a torch optimizer.

The train step calls ``optim_context(model)`` around the forward and ``update_params(loss)`` after
it. The strategy the wrapper is bound to decides how gradients are synchronised; the wrapper decides
when (only on the final micro-step of an accumulation window).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memfit.errors import ConfigError
from memfit.precision import Precision, default_amp_dtype, parse_dtype
from memfit.registry import OPTIM_WRAPPERS

logger = logging.getLogger("memfit")


@OPTIM_WRAPPERS.register()
class OptimWrapper:
    """Wrap ``optimizer``; ``accumulative_counts=k`` updates every k micro-steps.

    The loss is divided by k (by the real count in an epoch's last, incomplete window); gradients
    are synchronised only on the final micro-step. ``clip_grad=dict(max_norm=..., norm_type=2)``
    clips before the step; the norm is kept (as a tensor) for logging.
    """

    def __init__(self, optimizer: Optimizer, accumulative_counts: int = 1, clip_grad: dict | None = None) -> None:
        if not isinstance(accumulative_counts, int) or accumulative_counts < 1:
            raise ConfigError(f"optim_wrapper.accumulative_counts={accumulative_counts!r}: use an int >= 1")
        if clip_grad is not None:
            unknown = set(clip_grad) - {"max_norm", "norm_type", "error_if_nonfinite", "foreach", "type"}
            if unknown or "max_norm" not in clip_grad:
                raise ConfigError(f"optim_wrapper.clip_grad={clip_grad!r}: use dict(max_norm=..., norm_type=2)")
            if clip_grad.get("type", "norm") != "norm":
                raise ConfigError("optim_wrapper.clip_grad.type: only 'norm' clipping is supported")
        self.optimizer = optimizer
        self.accumulative_counts = accumulative_counts
        self.clip_grad = {k: v for k, v in (clip_grad or {}).items() if k != "type"} or None
        self.precision = Precision(None, "cpu")
        self.scaler: torch.amp.GradScaler | None = None
        self.strategy: Any = None
        self.inner_count = 0  # micro-steps taken in the current counting span (epoch or run)
        self.max_counts = -1  # length of that span; -1 = unbounded
        self.grad_norm: torch.Tensor | None = None
        self._bn_warned = False

    # -- binding -----------------------------------------------------------------------------
    def bind(self, strategy: Any, device: torch.device) -> None:
        """Called by the strategy once the model is on its device."""
        self.strategy = strategy
        self.precision = Precision(None, device.type)

    # -- counting ----------------------------------------------------------------------------
    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Start a counting span (an epoch, or the whole run for iteration-based training)."""
        self.inner_count = init_counts
        self.max_counts = max_counts
        if self.accumulative_counts > 1 and not self._bn_warned and _has_train_bn(model):
            self._bn_warned = True
            logger.warning(
                "accumulative_counts>1 with BatchNorm in train mode: BN statistics use the micro-batch, "
                "so results differ from one large batch (freeze BN or use GroupNorm/SyncBN)"
            )

    def should_update(self) -> bool:
        """True when the micro-step being run closes a window (or the span)."""
        k = self.accumulative_counts
        return (self.inner_count + 1) % k == 0 or self.inner_count + 1 == self.max_counts

    def should_sync(self) -> bool:
        return self.should_update()

    def loss_factor(self) -> int:
        """k, or the size of the span's last, incomplete window when inside it."""
        k = self.accumulative_counts
        if self.max_counts > 0:
            tail = self.max_counts % k
            if tail and self.inner_count >= self.max_counts - tail:
                return tail
        return k

    # -- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        """Autocast, and no gradient sync on non-final micro-steps."""
        sync = self.strategy.grad_sync_context(model, self.should_sync()) if self.strategy else contextlib.nullcontext()
        with sync, self.precision.autocast():
            yield

    def update_params(
        self, loss: torch.Tensor, step_kwargs: dict | None = None, zero_kwargs: dict | None = None
    ) -> None:
        """Backward the (scaled) loss; step and zero gradients when the window closes."""
        factor = self.loss_factor()
        if factor > 1:
            loss = loss / factor
        self.backward(loss)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))
        self.inner_count += 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        if self.strategy is not None:
            self.strategy.backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def step(self, **kwargs: Any) -> None:
        if self.clip_grad:
            self.grad_norm = self._clip_grads()
        self.optimizer.step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        self.optimizer.zero_grad(**kwargs)

    def _clip_grads(self) -> torch.Tensor:
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.strategy is not None:
            return self.strategy.clip_grad_norm(params, **self.clip_grad)
        return nn.utils.clip_grad_norm_(params, **self.clip_grad)

    # -- introspection and state -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_lr(self) -> dict[str, list[float]]:
        return {"lr": [g["lr"] for g in self.optimizer.param_groups]}

    def get_momentum(self) -> dict[str, list[float]]:
        out = []
        for g in self.optimizer.param_groups:
            out.append(g["betas"][0] if "betas" in g else g.get("momentum", 0.0))
        return {"momentum": out}

    def log_scalars(self) -> dict[str, Any]:
        """Scalars the logger shows for this wrapper (tensors are fine: converted when printed)."""
        return {"grad_norm": self.grad_norm} if self.grad_norm is not None else {}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "inner_count": self.inner_count}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.inner_count = state.get("inner_count", self.inner_count)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, k={self.accumulative_counts})"


@OPTIM_WRAPPERS.register()
class AmpOptimWrapper(OptimWrapper):
    """Mixed precision: autocast around the forward; a GradScaler for float16 only.

    ``dtype`` is 'float16', 'bfloat16' or None (float16 on CUDA, bfloat16 on CPU). ``loss_scale`` is
    'dynamic', a fixed number or GradScaler kwargs. ``fp32_modules`` names modules or module types
    that run in fp32 with autocast off (numerically sensitive heads, losses).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        dtype: str | torch.dtype | None = None,
        loss_scale: str | float | dict = "dynamic",
        fp32_modules: list[str] | None = None,
        accumulative_counts: int = 1,
        clip_grad: dict | None = None,
        use_fsdp: bool = False,  # accepted for MMEngine configs; the strategy decides
    ) -> None:
        super().__init__(optimizer, accumulative_counts, clip_grad)
        self.dtype = parse_dtype(dtype, "optim_wrapper.dtype")
        self.loss_scale = loss_scale
        self.fp32_modules = list(fp32_modules or [])
        self.skipped_steps = torch.zeros((), dtype=torch.long)

    def bind(self, strategy: Any, device: torch.device) -> None:
        super().bind(strategy, device)
        dtype = self.dtype or default_amp_dtype(device.type)
        self.precision = Precision(dtype, device.type)
        self.scaler = self.precision.make_scaler(self.loss_scale)
        self.skipped_steps = self.skipped_steps.to(device)

    def step(self, **kwargs: Any) -> None:
        if self.scaler is None:
            return super().step(**kwargs)
        self.scaler.unscale_(self.optimizer)
        if self.clip_grad:
            self.grad_norm = self._clip_grads()
        before = self.scaler._scale.clone()  # tensor compare: no host sync in the step
        self.scaler.step(self.optimizer, **kwargs)
        self.scaler.update()
        self.skipped_steps += (self.scaler._scale < before).long().squeeze()

    def log_scalars(self) -> dict[str, Any]:
        out = super().log_scalars()
        if self.scaler is not None and self.scaler._scale is not None:
            out.update(loss_scale=self.scaler._scale, skipped_steps=self.skipped_steps)
        return out

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
            state["skipped_steps"] = self.skipped_steps.cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
            self.skipped_steps = state["skipped_steps"].to(self.skipped_steps.device)


def _has_train_bn(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
