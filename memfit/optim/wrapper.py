"""Optimizer wrappers: accumulation counting, loss division and clipping around a torch optimizer.

The train step calls ``optim_context(model)`` around the forward and ``update_params(loss)`` after
it. The wrapper is backend-agnostic: it decides *when* (gradients are synchronised and the
optimizer steps only on the final micro-step of an accumulation window); its strategy decides
*how* (``no_sync``, ``backward``, ``optimizer_step``, ``zero_grad``), and the strategy's precision
how the forward runs and the loss is scaled. A wrapper used on its own (the ``optim_wrapper_cfg`` of
MMEngine's memory-saving guide in a loop without a runner) gets a one-device strategy with the precision
its own arguments ask for.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from memfit.errors import warn_ignored
from memfit.optim.spec import check_accumulative_counts, check_clip_grad
from memfit.precision import Precision, parse_dtype, resolve_precision
from memfit.precision.scaler import check_loss_scale
from memfit.registry import OPTIM_WRAPPERS

logger = logging.getLogger("memfit")


@OPTIM_WRAPPERS.register()
class OptimWrapper:
    """Wrap ``optimizer``; ``accumulative_counts=k`` updates every k micro-steps.

    The loss is divided by k (by the real count in an epoch's last, incomplete window); gradients
    are synchronised only on the final micro-step. ``clip_grad=dict(max_norm=..., norm_type=2)``
    clips before the step; the norm is kept (as a tensor) for logging.
    """

    # CheckInvalidLossHook(action='skip') sets skip_nonfinite: a micro-step whose loss is nan/inf gets
    # no backward and its window no optimizer step; nonfinite_losses counts them.
    skip_nonfinite = False
    nonfinite_losses = 0
    _window_nonfinite = False

    def __init__(self, optimizer: Optimizer, accumulative_counts: int = 1, clip_grad: dict | None = None) -> None:
        self.optimizer = optimizer
        self.accumulative_counts = check_accumulative_counts(accumulative_counts)
        self.clip_grad = check_clip_grad(clip_grad)
        self._strategy: Any = None
        # MMEngine's pseudo group: with several param groups the schedulers also schedule the
        # optimizer's defaults, which get_lr() reports as ``base_lr``.
        self.base_param_settings: dict | None = (
            {"params": [], **optimizer.defaults} if len(optimizer.param_groups) > 1 else None)
        # The merged group of each param group MMEngine's constructor makes (one per parameter under
        # paramwise_cfg), in its order: get_lr()/get_momentum() report those. Set by the builder; None: as built.
        self.original_groups: list[int] | None = None
        self.inner_count = 0  # micro-steps backpropagated in the current counting span (epoch or run)
        self.max_counts = -1  # length of that span; -1 = unbounded
        self.grad_norm: torch.Tensor | None = None
        self._bn_warned = False

    # -- strategy and precision ----------------------------------------------------------------
    def amp_options(self) -> dict | None:
        """What this wrapper asks of the precision (``AmpOptimWrapper``: dtype, loss_scale, fp32_modules), or
        None; :func:`memfit.precision.resolve_precision` decides."""
        return None

    @property
    def strategy(self) -> Any:
        """The strategy that backpropagates and steps; set by :func:`memfit.connector.setup`.
        Unset (a wrapper used on its own): one device, with this wrapper's requested precision."""
        if self._strategy is None:
            from memfit.strategies.single import SingleDeviceStrategy

            device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
            strategy = SingleDeviceStrategy()
            strategy.device = device
            strategy.set_precision(resolve_precision(self, strategy, device.type))
            self._strategy = strategy
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: Any) -> None:
        self._strategy = strategy

    @property
    def precision(self) -> Precision:
        return self.strategy.precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self.precision, "scaler", None)

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
        """After ``backward``: True when the micro-step just counted closes a window (or the span).
        MMEngine's manual loop: ``backward(loss); if should_update(): step(); zero_grad()``."""
        return self.inner_count % self.accumulative_counts == 0 or self.inner_count == self.max_counts

    def window_open(self) -> bool:
        """Between iterations: micro-steps were backpropagated that no optimizer step has taken yet."""
        return not self.should_update()

    def should_sync(self) -> bool:
        """Before ``backward``: True when the coming micro-step closes a window (gradients synchronise)."""
        k = self.accumulative_counts
        return (self.inner_count + 1) % k == 0 or self.inner_count + 1 == self.max_counts

    def loss_factor(self) -> int:
        """k, or the size of the span's last, incomplete window when inside it."""
        k = self.accumulative_counts
        if self.max_counts > 0:
            tail = self.max_counts % k
            if tail and self.inner_count >= self.max_counts - tail:
                return tail
        return k

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss divided by the window's size (MMEngine's ``scale_loss``)."""
        factor = self.loss_factor()
        return loss / factor if factor > 1 else loss

    # -- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def optim_context(self, model: nn.Module):
        """The precision's autocast, and no gradient sync on non-final micro-steps (also for a plain
        ``DistributedDataParallel`` model: its ``no_sync``, as MMEngine's)."""
        strategy = self.strategy
        with strategy.no_sync(model, self.should_sync()), strategy.autocast():
            yield

    def update_params(
        self, loss: torch.Tensor, step_kwargs: dict | None = None, zero_kwargs: dict | None = None
    ) -> None:
        """Backward the loss (divided by the window size); step and zero gradients when the window closes."""
        loss = self.scale_loss(loss)
        if self.skip_nonfinite and not bool(torch.isfinite(loss.detach()).all()):  # a host sync, opt-in
            self.nonfinite_losses += 1
            self._window_nonfinite = True  # no backward; the window's optimizer step is skipped
            self.inner_count += 1
        else:
            self.backward(loss)
        if self.should_update():
            if not self._window_nonfinite:
                self.step(**(step_kwargs or {}))
            self._window_nonfinite = False
            self.zero_grad(**(zero_kwargs or {}))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate through the strategy and count the micro-step (as MMEngine's ``backward``)."""
        self.strategy.backward(loss, **kwargs)
        self.inner_count += 1

    def step(self, **kwargs: Any) -> None:
        norm = self.strategy.optimizer_step(self.optimizer, self.clip_grad, **kwargs)
        if norm is not None:
            self.grad_norm = norm

    def zero_grad(self, **kwargs: Any) -> None:
        self.strategy.zero_grad(self.optimizer, **kwargs)

    # -- introspection and state -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's groups, plus MMEngine's ``base_param_settings`` pseudo group when there are
        several: what the param schedulers change."""
        groups = self.optimizer.param_groups
        return groups + [self.base_param_settings] if self.base_param_settings is not None else groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def get_lr(self) -> dict[str, list[float]]:
        """``{'lr': [one per param group]}``, and ``'base_lr'`` (the scheduled default) with several groups.

        Under ``paramwise_cfg`` one entry per group MMEngine's constructor makes (one per trainable
        parameter, in ``named_modules()`` order), though memfit's optimizer merges equal ones."""
        out = {"base_lr": [self.base_param_settings["lr"]]} if self.base_param_settings is not None else {}
        out["lr"] = self._per_original_group([g["lr"] for g in self.optimizer.param_groups])
        return out

    def get_momentum(self) -> dict[str, list[float]]:
        """``{'momentum': [one per param group]}`` (as :meth:`get_lr`): SGD's momentum, Adam's beta1, else 0."""
        out = []
        for g in self.optimizer.param_groups:
            out.append(g["momentum"] if "momentum" in g else g["betas"][0] if "betas" in g else 0.0)
        return {"momentum": self._per_original_group(out)}

    def _per_original_group(self, values: list) -> list:
        index = self.original_groups
        if not index or max(index) >= len(values):  # not built from paramwise_cfg, or regrouped since
            return values
        return [values[i] for i in index]

    def log_scalars(self) -> dict[str, Any]:
        """Scalars the logger shows (tensors are fine: converted when printed)."""
        out = {"grad_norm": self.grad_norm} if self.grad_norm is not None else {}
        out.update(self.strategy.log_scalars())
        return out

    def state_dict(self) -> dict:
        """MMEngine's shape: the optimizer's own state dict, with ``base_param_settings`` (several
        groups) and ``loss_scaler`` (fp16) added. The accumulation position is not in it: the
        checkpoint keeps it apart (:meth:`checkpoint_state`)."""
        state = self.optimizer.state_dict()
        if self.base_param_settings is not None:
            state["base_param_settings"] = _plain_group(self.base_param_settings)
        if "loss_scaler" in (extra := self.precision.state_dict()):
            state["loss_scaler"] = extra["loss_scaler"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a state from :meth:`state_dict` or a plain ``optimizer.state_dict()`` (or memfit's
        checkpoint form, see :meth:`checkpoint_state`)."""
        if "param_groups" not in state:
            return self.load_checkpoint_state(state)
        state = dict(state)
        self._load_extras(state.pop("base_param_settings", None), state.pop("loss_scaler", None))
        self.optimizer.load_state_dict(state)

    def checkpoint_state(self, with_optimizer: bool = True) -> dict:
        """What a checkpoint keeps: the optimizer (unless a backend writes its shards itself,
        ``with_optimizer=False``), the accumulation position, the precision's state and, where
        ``check_invalid_loss`` skips, the non-finite losses counted and whether the open window skips its step."""
        state = {"inner_count": self.inner_count, **self.precision.state_dict()}
        if self.nonfinite_losses or self._window_nonfinite:
            state["nonfinite"] = {"losses": self.nonfinite_losses, "window": self._window_nonfinite}
        if self.base_param_settings is not None:
            state["base_param_settings"] = _plain_group(self.base_param_settings)
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.inner_count = state.get("inner_count", self.inner_count)
        nonfinite = state.get("nonfinite") or {}
        self.nonfinite_losses = int(nonfinite.get("losses", 0))
        self._window_nonfinite = bool(nonfinite.get("window", False))
        self._load_extras(state.get("base_param_settings"), None)
        self.precision.load_state_dict(state)

    def _load_extras(self, base: dict | None, loss_scaler: dict | None) -> None:
        if base is not None and self.base_param_settings is not None:
            self.base_param_settings.update({k: v for k, v in base.items() if k != "params"})
        if loss_scaler is not None and self.scaler is not None:
            self.precision.load_state_dict({"loss_scaler": loss_scaler})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, k={self.accumulative_counts})"


@OPTIM_WRAPPERS.register()
class AmpOptimWrapper(OptimWrapper):
    """Mixed precision (MMEngine's name): asks for autocast, the connector makes it the run's precision.

    ``dtype`` is 'float16', 'bfloat16' or None (the device's default). ``loss_scale`` is 'dynamic',
    a fixed number or GradScaler kwargs (fp16 only). ``fp32_modules`` names modules or module types
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
        use_fsdp: bool = False,  # MMEngine's switch to its sharded grad scaler; here the strategy decides
    ) -> None:
        super().__init__(optimizer, accumulative_counts, clip_grad)
        if use_fsdp:
            warn_ignored("optim_wrapper.use_fsdp", "the strategy decides FSDP (strategy='fsdp' or "
                         "dict(type='FSDPStrategy')); the loss scaling follows the strategy")
        self.dtype = parse_dtype(dtype, "optim_wrapper.dtype")
        check_loss_scale(loss_scale)  # whatever the dtype: a bad value fails when the wrapper is built
        self.loss_scale = loss_scale
        self.fp32_modules = list(fp32_modules or [])

    def amp_options(self) -> dict | None:
        return dict(dtype=self.dtype, loss_scale=self.loss_scale, fp32_modules=self.fp32_modules)

    @property
    def skipped_steps(self) -> torch.Tensor:
        """fp16: optimizer steps the GradScaler skipped (gradients overflowed), a tensor."""
        return getattr(self.precision, "skipped_steps", torch.zeros((), dtype=torch.long))


def _plain_group(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _has_train_bn(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
