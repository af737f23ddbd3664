"""Activation offload: keep the tensors a module saves for backward in host memory.

``apply_activation_offload(model, ['backbone'])`` is ``cfg=dict(activation_offload=['backbone'])``.
Each named module's forward runs under ``torch.autograd.graph.save_on_cpu``: every tensor autograd
saves inside it is copied to the CPU during forward and back to the device when backward needs it.
On CUDA the host buffers are pinned so the copies are asynchronous; the GPU then holds the module's
activations only while its forward and backward run. The cost is PCIe traffic (two copies of each
saved tensor) and host memory. On a CPU-only run tensors are already in host memory, so it changes
nothing (and the tracker shows no saving) but stays exact.

Modules keep their identity (only ``forward`` is replaced, as for activation checkpointing), and a
module is never wrapped twice: one already offloaded or checkpointed by memfit, or inside/around
one that is, is skipped with a warning (a checkpointed module saves almost nothing to offload).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.errors import ConfigError
from memfit.memory.wrapping import WrappedForward, install, resolve_modules

logger = logging.getLogger("memfit")


class OffloadedForward(WrappedForward):
    """``forward`` with saved activations kept in (pinned, on CUDA) host memory."""

    kind = "activation offload"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.orig(*args, **kwargs)
        # Pinned host buffers only for activations that live on a GPU: a pinned copy of a CPU tensor
        # is a fresh contiguous tensor, which changes the strides (and the bits) backward computes with.
        on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves((args, kwargs)))
        with torch.autograd.graph.save_on_cpu(pin_memory=on_gpu):
            return self.orig(*args, **kwargs)


def apply_activation_offload(model: nn.Module, names: list[str]) -> list[str]:
    """Offload the activations saved by each named module to host memory; return the names wrapped.

    Saves device memory roughly equal to what the modules save for backward, at the cost of a
    device-to-host and a host-to-device copy of each saved tensor. Unknown names are a ConfigError
    listing near matches.
    """
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"activation_offload must be a list of module names, got {type(names).__name__}")
    chosen = resolve_modules(model, names, "activation_offload")
    done = install(model, chosen, OffloadedForward, "activation_offload")
    if done:
        logger.info(f"activation offload to CPU on {len(done)} modules: {', '.join(done)}")
    return done

