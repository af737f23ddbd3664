"""The Strategy interface: where a model runs, how it is wrapped, backpropagated, stepped and saved.

The runner builds the model, applies the memory techniques and the precision's conversion, then
calls :meth:`Strategy.wrap` and :meth:`Strategy.setup` (torchtitan's order: apply_ac, then
apply_fsdp). The optimizer wrapper counts micro-steps and calls :meth:`no_sync`, :meth:`backward`,
:meth:`optimizer_step` and :meth:`zero_grad`; the loops never name a strategy. A backend overrides
only what it changes, in one file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.checkpoint import load_checkpoint as load_state_file
from memfit.checkpoint import save_checkpoint as save_state_file
from memfit.precision import Precision
from memfit.strategies.capabilities import Capabilities


class Strategy:
    """Base strategy: one process, one device. Subclasses override what their backend changes."""

    # What this backend does (memfit.strategies.capabilities): the connector, the planner and the hooks ask
    # this, never the class's name. A property in backends whose options change it.
    capabilities: Capabilities = Capabilities()

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.precision: Precision = Precision()
        self.env_ready = False  # setup_env has run (the connector runs it when nobody did)

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """Join the process group (if launched for it) and pick this process's device."""
        env_cfg = env_cfg or {}
        dist_cfg = dict(env_cfg.get("dist_cfg") or {})
        dist.init_process_group(launcher, backend=dist_cfg.get("backend"), timeout_s=dist_cfg.get("timeout"))
        self.device = dist.default_device()
        self.precision.to_device(self.device)
        self.env_ready = True
        from memfit.speed.cudnn import apply_cudnn_benchmark

        apply_cudnn_benchmark(bool(env_cfg.get("cudnn_benchmark")), self.device)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def set_micro_batch_size(self, batch_size: int | None) -> None:
        """The train loader's per-rank batch size, told before :meth:`setup` (DeepSpeed's config needs it)."""

    # -- precision ---------------------------------------------------------------------------
    def precision_request(self) -> Precision | None:
        """The precision this strategy's own options ask for (DeepSpeed's fp16/bf16, FSDP's
        mixed_precision), or None. The connector reconciles it with the optimizer wrapper's."""
        return None

    def check_precision(self, precision: Precision) -> None:
        """Raise ConfigError (one line) if this backend cannot run ``precision``."""
        from memfit.precision import HalfPrecision

        if isinstance(precision, HalfPrecision):
            from memfit.errors import ConfigError

            raise ConfigError(f"{type(self).__name__} has no whole-model {precision.name} mode: use "
                              "optim_wrapper=dict(type='AmpOptimWrapper', dtype=...) (autocast)")

    def refuse_master_weights(self, precision: Precision, own: str) -> None:
        """A sharding backend keeps fp32 master weights itself: memfit's Apex O2/O3 precision
        (:class:`~memfit.precision.MasterWeightsPrecision`) is refused, pointing to the backend's ``own``."""
        from memfit.precision import MasterWeightsPrecision

        if isinstance(precision, MasterWeightsPrecision):
            from memfit.errors import ConfigError

            raise ConfigError(f"precision=dict(opt_level={precision.opt_level!r}) keeps fp32 master weights in memfit "
                              f"(SingleDeviceStrategy, DDPStrategy); {type(self).__name__} keeps its own: use {own}")

    def use_optim_wrapper(self, name: str) -> None:
        """The config's optimizer wrapper is ``name``, one of ``capabilities.optim_wrappers`` (MMEngine's
        backend wrapper names): switch on what it stands for."""

    def set_precision(self, precision: Precision) -> None:
        self.check_precision(precision)
        self.precision = precision
        precision.to_device(self.device)

    # -- model and optimizer -----------------------------------------------------------------
    def to_device(self, model: nn.Module) -> nn.Module:
        tensors = [*model.parameters(), *model.buffers()]
        if any(t.device != self.device for t in tensors):  # a no-op move would swap fake tensors, which fails
            model = model.to(self.device)
        pre = getattr(model, "data_preprocessor", None)
        if pre is not None and hasattr(pre, "device"):
            pre.device = self.device
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap or shard ``model`` for this backend after the memory techniques were applied.

        Returns the model the runner keeps: the same module (sharded in place, or with its forward
        routed through a wrapper, see :mod:`memfit.strategies.route`), so its ``train_step``,
        attributes and state-dict keys are the user's."""
        return model

    def setup(self, model: nn.Module, optim_wrapper: Any) -> None:
        """Finish the set-up once the optimizer is built over the wrapped model (``optim_wrapper`` is
        None when only evaluating). A backend may replace ``optim_wrapper.optimizer`` (ZeRO-1) or build
        its engine around it; ``optim_wrapper.optimizer`` stays the object whose ``param_groups`` the
        LR schedulers change."""

    # -- the planner's fake step -------------------------------------------------------------
    @classmethod
    def fake_step_options(cls, cfg: dict) -> dict:
        """``cfg`` (this strategy's config dict) written the one way that runs the same fake step: options that
        change nothing on fake CPU tensors dropped or set to their default, so the planner runs it once."""
        return cfg

    def prepare_fake_step(self) -> None:
        """Adapt this strategy to run the planner's step on fake tensors (``capabilities.fake_step``)."""

    def communication_bytes(self, model: nn.Module) -> int:
        """Memory the backend's communication buffers hold beyond the model's own tensors, for the planner
        where its fake step cannot allocate them."""
        return 0

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """The context the training forward runs in (the precision's autocast)."""
        return self.precision.autocast()

    def no_sync(self, model: nn.Module, sync: bool) -> Any:
        """A context around the forward after which backward does (sync=True) or does not reduce
        gradients across ranks (accumulation's non-final micro-steps). A model the user wrapped
        themselves (a plain ``DistributedDataParallel``) is asked through its own ``no_sync``."""
        if not sync and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.precision.scale_loss(loss).backward(**kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip_grad: dict | None = None,
                       **kwargs: Any) -> torch.Tensor | None:
        """Unscale, clip (returns the norm, a tensor), step. Called once per accumulation window."""
        self.precision.unscale(optimizer)
        norm = self.clip(optimizer, clip_grad)
        self.precision.step(optimizer, **kwargs)
        return norm

    def clip(self, optimizer: torch.optim.Optimizer, clip_grad: dict | None) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters by ``clip_grad``; the norm, or None."""
        if not clip_grad:
            return None
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return self.clip_grad_norm(params, **clip_grad)

    def zero_grad(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        self.precision.zero_grad(optimizer, **kwargs)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                       **kw: Any) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, **kw)

    def log_scalars(self) -> dict[str, Any]:
        """Scalars for the log line (loss scale, skipped steps): tensors, converted when printed."""
        return self.precision.log_scalars()

    # -- state -------------------------------------------------------------------------------
    def load_weights(self, model: nn.Module, path: Any, **options: Any) -> Any:
        """``load_from``: weights only (sharding backends gather around it)."""
        from memfit.checkpoint import load_weights

        return load_weights(model, path, **options)

    def model_state_dict(self, model: nn.Module) -> Any:
        """The full (unsharded) model state dict; sharded backends return shards or a reference."""
        return model.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        return model.load_state_dict(state, strict=strict)

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        """The optimizer wrapper's state to checkpoint (sharded strategies return their shards)."""
        return wrapper.checkpoint_state()

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        """Load ``state`` into ``wrapper``; an optimizer state keyed by parameter name (from a sharded
        checkpoint read in one process) is mapped onto this optimizer's parameters."""
        osd = state.get("optimizer")
        groups = osd.get("param_groups", []) if isinstance(osd, dict) else []
        if groups and all(isinstance(p, str) for g in groups for p in g["params"]):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, wrapper.optimizer, osd, options=StateDictOptions(full_state_dict=True))
            state = {**state, "optimizer": wrapper.optimizer.state_dict()}
        wrapper.load_checkpoint_state(state)

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
            from memfit.checkpoint.dcp import read_sharded_checkpoint

            return read_sharded_checkpoint(path)
        return load_state_file(path)
