"""What a strategy does, declared by the strategy itself.

The connector, the planner and the hooks ask a strategy's :class:`Capabilities`, never its name: a
strategy registered by a user (one file, one ``@STRATEGIES.register()`` line) is treated by what it
declares. Each strategy class sets ``capabilities`` (a property where its options change them:
``DDPStrategy(zero=True)`` shards the optimizer state, ``FSDPStrategy(reshard_after_forward=False)``
keeps the parameters whole between forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDABLE = ("optimizer", "gradients", "parameters")  # ZeRO's stages 1, 2 and 3 add one each, in this order


@dataclass(frozen=True)
class Capabilities:
    """What a strategy does.

    ``shards``: what is split over the ranks during the step (of :data:`SHARDABLE`; ``parameters``
    only when they are also freed after each block's forward, ZeRO-3). ``data_parallel``: gradients
    are reduced across ranks (a process group, also at one rank). ``offloads_parameters``: the sharded
    parameters wait on the host between uses. ``own_optimizer``: the backend replaces or steps the
    optimizer itself (ZeRO-1's ZeroRedundancyOptimizer, an engine). ``own_offload``: how the backend
    offloads its optimizer with its own options (memfit's ``optimizer_offload`` is refused, pointing
    there). ``contiguous_parameters``: the backend flattens or shards the parameters and needs them
    contiguous (channels_last then converts the batch only). ``fake_step``: the planner can run the
    training step on fake tensors. ``optim_wrappers``: MMEngine optimizer-wrapper names that stand for
    this strategy (``DeepSpeedOptimWrapper``). ``config_hint``: how a config names it, for messages.
    ``sharded_checkpoints``: saves each checkpoint as a directory of shards (``epoch_1.pth/``), not one file.
    ``partial_gradients``: a checkpoint saved inside an accumulation window keeps the window's partial
    gradients (they are the parameters' ``.grad``); False where the backend keeps them in its own buffers
    (FSDP2 without gradient sync, DeepSpeed, colossalai): checkpoints then wait for the window's end.
    The precision a backend's own options ask for is :meth:`Strategy.precision_request`.
    """

    shards: frozenset[str] = frozenset()
    data_parallel: bool = False
    offloads_parameters: bool = False
    own_optimizer: bool = False
    own_offload: str = ""
    contiguous_parameters: bool = False
    fake_step: bool = True
    optim_wrappers: frozenset[str] = frozenset()
    config_hint: str = ""
    sharded_checkpoints: bool = False
    partial_gradients: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.shards) - set(SHARDABLE)
        if unknown:
            raise ValueError(f"Capabilities.shards: {sorted(unknown)} are not of {SHARDABLE}")

    @property
    def sharding(self) -> str:
        """The planner's word for what is sharded: 'none', 'zero1' (optimizer state), 'zero2' (and
        gradients) or 'fsdp' (and parameters)."""
        if "parameters" in self.shards:
            return "fsdp"
        if "gradients" in self.shards:
            return "zero2"
        return "zero1" if "optimizer" in self.shards else "none"

    @property
    def one_device(self) -> bool:
        """The whole model trains in this process and memfit steps it (no reduction across ranks)."""
        return not self.data_parallel and not self.shards and not self.own_optimizer


def shards_up_to(stage: int) -> frozenset[str]:
    """What ZeRO stage ``stage`` (0-3) shards."""
    return frozenset(SHARDABLE[:max(0, min(stage, 3))])
