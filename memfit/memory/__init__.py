"""Memory techniques: functions applied to the built model before the strategy wraps it.

``apply_memory_techniques`` reads the memory switches (as in MMEngine's memory-saving guide) from the
runner's ``cfg`` and applies each in an order that composes: Conv-BN folding, activation checkpointing,
activation offload. (fp32 islands belong to the precision: :mod:`memfit.precision.fp32_islands`.) Each
technique is a module of its own (``conv_bn``, ``checkpointing``, ``offload``; ``wrapping`` is the forward
replacement the last two share). Measuring what they save is :mod:`memfit.measure`'s work, not this
package's.
"""

from __future__ import annotations

from torch import nn

__all__ = ["apply_memory_techniques"]


def apply_memory_techniques(model: nn.Module, cfg: dict) -> None:
    """Apply ``efficient_conv_bn_eval``, ``activation_checkpointing`` and ``activation_offload`` from
    ``cfg`` to ``model`` in place."""
    if cfg.get("efficient_conv_bn_eval"):
        from memfit.memory.conv_bn import apply_efficient_conv_bn_eval

        names = cfg["efficient_conv_bn_eval"]
        apply_efficient_conv_bn_eval(model, [names] if isinstance(names, str) else list(names))
    if cfg.get("activation_checkpointing"):
        from memfit.memory.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, cfg["activation_checkpointing"])
    if cfg.get("activation_offload"):
        from memfit.memory.offload import apply_activation_offload

        names = cfg["activation_offload"]
        apply_activation_offload(model, [names] if isinstance(names, str) else list(names))
