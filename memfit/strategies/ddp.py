"""DDPStrategy: DistributedDataParallel, optionally with ZeRO-1 optimizer-state sharding.

The model is replicated; gradients are all-reduced during backward by DDP's hooks, which fire only
when the forward ran through the DDP module. The runner keeps the user's model and calls its own
``train_step``; its forward is routed through DDP (:mod:`memfit.strategies.route`) while gradients
are enabled, so evaluation runs the plain model and issues no collectives.

ZeRO-1 (VISSL's ``OPTIMIZER.name: zero``): ``DDPStrategy(zero=True)`` or
``optim_wrapper=dict(type='ZeroOptimWrapper', ...)`` (the connector maps it) replaces the optimizer with
``torch.distributed.optim.ZeroRedundancyOptimizer``, so each rank keeps the optimizer state of its
share of the parameters only. Checkpoints consolidate that state on rank 0 into one file in
``torch.optim``'s format, which loads at any world size, with or without ZeRO.

Several optimizers (GANs): ``DDPStrategy(separate=True)``, switched on by an ``OptimWrapperDict`` or
MMEngine's ``model_wrapper_cfg=dict(type='MMSeparateDistributedDataParallel')``, gives each submodule
its own DDP (:mod:`memfit.strategies.ddp_separate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from memfit import dist
from memfit.errors import ConfigError
from memfit.registry import STRATEGIES, check_kwargs
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities, shards_up_to
from memfit.strategies.ddp_separate import separate_no_sync, wrap_separately
from memfit.strategies.route import route_forward


def shard_optimizer(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """The same optimizer (class, parameter groups and hyper-parameters) as a ZeroRedundancyOptimizer.

    Built from a fresh optimizer, so nothing but its configuration is carried over. ZeRO's overlap
    mode is not used: it needs DDP communication hooks and cannot run with the gloo backend.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if not dist.is_distributed():
        raise ConfigError("ZeRO optimizer sharding needs a process group: use strategy='ddp' (DDPStrategy)")
    if any(optimizer.state.values()):
        raise ConfigError("ZeRO: the optimizer already holds state; shard it before the first step")
    import inspect

    # ``defaults`` may hold keys the constructor does not take (AdamW's decoupled_weight_decay).
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)


@STRATEGIES.register()
class DDPStrategy(Strategy):
    """Data parallel with DistributedDataParallel; ``zero=True`` shards optimizer state (ZeRO-1).

    ``find_unused_parameters``, ``broadcast_buffers`` and ``static_graph`` are DDP's options; any
    other keyword (``bucket_cap_mb``, ``gradient_as_bucket_view``, ...) is passed to DDP as well.
    ``device_ids`` is set only on CUDA (DDP on CPU takes none). ``separate=True``: one DDP per direct
    child with trainable parameters instead of one around the model (None: only for several optimizers).
    """

    def __init__(self, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 static_graph: bool = False, zero: bool = False, separate: bool | None = None,
                 **ddp_kwargs: Any) -> None:
        super().__init__()
        ddp_kwargs.pop("type", None)  # from model_wrapper_cfg=dict(type='MMDistributedDataParallel', ...)
        import inspect

        # torch 2.14 renamed broadcast_buffers (deprecated) to forward_sync_buffers; buffers are
        # still synchronised from rank 0 at construction either way.
        sync_key = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
            DistributedDataParallel).parameters else "broadcast_buffers"
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                               **{sync_key: broadcast_buffers}, **ddp_kwargs)
        # Checked here, where the config is read, not when the model is wrapped.
        check_kwargs(DistributedDataParallel, {"module": None, **self.ddp_kwargs}, "DDPStrategy")
        if not isinstance(zero, bool):  # zero=3 would have been ZeRO-1
            raise ConfigError(f"strategy.zero={zero!r}: DDPStrategy's zero is True (ZeRO-1: optimizer state sharded) "
                              "or False; for ZeRO-2/3 use FSDPStrategy (ZeRO-2: reshard_after_forward=False) or "
                              "DeepSpeedStrategy's zero_optimization.stage")
        self.zero = zero
        self.separate = separate
        self.ddp: DistributedDataParallel | None = None
        self.separate_ddps: dict[str, DistributedDataParallel] = {}

    @property
    def capabilities(self) -> Capabilities:
        """Data parallel; ZeRO-1 shards the optimizer state and replaces the optimizer."""
        return Capabilities(shards=shards_up_to(1 if self.zero else 0), data_parallel=True, own_optimizer=self.zero,
                            optim_wrappers=frozenset({"ZeroOptimWrapper"}), config_hint="strategy='ddp' (DDPStrategy)")

    def use_optim_wrapper(self, name: str) -> None:
        """``ZeroOptimWrapper`` (or MMEngine's ``ZeroRedundancyOptimizer`` optimizer type) switches ZeRO-1 on."""
        self.zero = True

    def prepare_fake_step(self) -> None:
        """DDP's reducer is C++ that reads tensor data, which fake tensors have none of: the model runs
        unwrapped (ZeRO-1's sharded optimizer is still the real one)."""
        self.wrap = lambda model: model  # type: ignore[method-assign]

    def communication_bytes(self, model: nn.Module) -> int:
        """DDP's buckets: one copy of the trainable parameters' gradients (gradient_as_bucket_view=False)."""
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """As the base, and a one-process group when not launched, so the same config runs anywhere."""
        super().setup_env(dist.launcher_from_env(launcher), env_cfg)
        dist.ensure_process_group((env_cfg or {}).get("dist_cfg") or {})

    def wrap(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (evaluation of a frozen model); DDP would refuse it
        device_ids = [self.device] if self.device.type == "cuda" else None
        if self.separate:
            self.ddp, self.separate_ddps = None, wrap_separately(model, device_ids, self.ddp_kwargs)
            return model
        self.ddp = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        return route_forward(model, self.ddp, when=torch.is_grad_enabled)

    def setup(self, model: nn.Module, optim_wrapper: Any) -> None:
        if optim_wrapper is not None and self.zero:
            optim_wrapper.optimizer = shard_optimizer(optim_wrapper.optimizer)

    def no_sync(self, model: nn.Module, sync: bool) -> Any:
        """DDP's ``no_sync`` on non-final micro-steps: the forward inside it skips preparing the
        all-reduce, so the backward that follows (outside the context) only accumulates locally."""
        if not sync and self.ddp is not None:
            return self.ddp.no_sync()
        if not sync and self.separate_ddps:
            return separate_no_sync(self.separate_ddps, model)
        return super().no_sync(model, sync)

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        """ZeRO: every rank sends its shard to rank 0, which holds the whole state (others hold none)."""
        optimizer = getattr(wrapper, "optimizer", None)  # an OptimWrapperDict has none (and no ZeRO)
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return wrapper.checkpoint_state()
        optimizer.consolidate_state_dict(to=0)
        # Only rank 0 writes the (file) checkpoint; the other ranks' copy is never saved.
        return wrapper.checkpoint_state() if dist.is_main_process() else {}
