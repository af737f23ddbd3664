"""The Strategy interface: how a model is placed, wrapped, backpropagated, stepped and saved.

The loops never name a strategy; they call the model's ``train_step`` and the optimizer wrapper,
which call back into the strategy for what differs between backends (gradient sync, backward,
clipping, state dicts, checkpoint I/O).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.checkpoint import load_checkpoint as load_state_file
from memfit.checkpoint import save_checkpoint as save_state_file


class Strategy:
    """Base strategy: one process, one device. Subclasses override what their backend changes."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """Join the process group (if launched for it) and pick this process's device."""
        env_cfg = env_cfg or {}
        dist_cfg = dict(env_cfg.get("dist_cfg") or {})
        dist.init_process_group(launcher, backend=dist_cfg.get("backend"), timeout_s=dist_cfg.get("timeout"))
        self.device = dist.default_device()
        if env_cfg.get("cudnn_benchmark") and self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    # -- model and optimizer -----------------------------------------------------------------
    def prepare(
        self,
        model: nn.Module,
        optim_wrapper: Any = None,
        transforms: Callable[[nn.Module], None] | None = None,
        optimizer_in_backward: bool = False,
    ) -> tuple[nn.Module, Any]:
        """Move ``model`` to the device, apply memory ``transforms``, wrap it, build the wrapper."""
        from memfit.optim.builder import build_optim_wrapper

        model = self.to_device(model)
        if transforms is not None:
            transforms(model)
        model = self.wrap_model(model)
        wrapper = None
        if optim_wrapper is not None:
            wrapper = build_optim_wrapper(self.unwrap(model), optim_wrapper, in_backward=optimizer_in_backward)
            wrapper.bind(self, self.device)
        return model, wrapper

    def to_device(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        pre = getattr(model, "data_preprocessor", None)
        if pre is not None and hasattr(pre, "device"):
            pre.device = self.device
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def set_micro_batch_size(self, batch_size: int | None) -> None:
        """The train loader's per-rank batch size, told before ``prepare`` (DeepSpeed's config needs it)."""

    def load_weights(self, model: nn.Module, path: Any, **options: Any) -> Any:
        """``load_from``: weights only into the unwrapped model (sharding backends gather around it)."""
        from memfit.checkpoint import load_weights

        return load_weights(self.unwrap(model), path, **options)

    # -- the step ----------------------------------------------------------------------------
    def grad_sync_context(self, model: nn.Module, sync: bool) -> Any:
        """A context in which backward does (sync=True) or does not all-reduce gradients."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, **kw: Any):
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, **kw)

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict, strict: bool = True) -> Any:
        return self.unwrap(model).load_state_dict(state, strict=strict)

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        """The optimizer wrapper's state to checkpoint (sharded strategies return their shards)."""
        return wrapper.state_dict()

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        """Load ``state`` into ``wrapper``; an optimizer state keyed by parameter name (from a sharded
        checkpoint read in one process) is mapped onto this optimizer's parameters."""
        osd = state.get("optimizer")
        groups = osd.get("param_groups", []) if isinstance(osd, dict) else []
        if groups and all(isinstance(p, str) for g in groups for p in g["params"]):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.unwrap(model), wrapper.optimizer, osd,
                                     options=StateDictOptions(full_state_dict=True))
            state = {**state, "optimizer": wrapper.optimizer.state_dict()}
        wrapper.load_state_dict(state)

    def save_checkpoint(self, path: str | Path, state: dict) -> bool | None:
        """Write ``state`` (model/optimizer already converted to state dicts) atomically; rank 0 only.

        Returns False when the write continues in the background (an async save): the caller must
        not point ``last_checkpoint`` at it; :meth:`finalize_checkpoints` does once it is complete.
        """
        if dist.is_main_process():
            save_state_file(state, path)
        dist.barrier()
        return True

    def finalize_checkpoints(self, abort: bool = False) -> None:
        """Complete pending background checkpoint writes (end of training); ``abort``: training
        failed, drop them. Nothing to do for strategies that save synchronously."""

    def load_checkpoint(self, path: str | Path) -> dict:
        """A checkpoint file, or a sharded directory gathered into full tensors in this process."""
        if Path(path).is_dir():
            from memfit.strategies.fsdp import read_sharded_checkpoint

            return read_sharded_checkpoint(path)
        return load_state_file(path)
