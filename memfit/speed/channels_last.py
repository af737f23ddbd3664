"""channels_last: 4-D weights and images stored NHWC, the layout cuDNN's fastest convolutions (and Tensor
Cores under autocast) use; in NCHW cuDNN transposes around each convolution.

``channels_last=True`` (a top-level technique key, or in ``cfg=dict(...)``) converts the model's 4-D
parameters and buffers in place (other tensors are untouched) and makes every 4-D floating-point tensor of
the batch channels_last (nested in dicts, lists and tuples): a forward hook on the model's
``data_preprocessor`` converts its output, so the NCHW batch it made on the device is freed at once; a model
without one gets a forward pre-hook converting its inputs. A convolution with a channels_last weight returns
channels_last output, so the layout then carries through the network. The values are the same to rounding
(another summation order in the kernels) and the same bytes are held: only the strides differ.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memfit.model.base import map_tensors

logger = logging.getLogger("memfit")


def to_channels_last(data: Any) -> Any:
    """``data`` with every 4-D floating-point tensor in channels_last (nested dicts, lists and tuples kept)."""
    return map_tensors(data, _tensor_to_channels_last)


def _tensor_to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t


def _inputs_to_channels_last(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return to_channels_last(args), to_channels_last(kwargs)


def _output_to_channels_last(module: nn.Module, args: tuple, output: Any) -> Any:
    return to_channels_last(output)


def _weights_to_channels_last(model: nn.Module) -> None:
    """Every 4-D parameter and buffer channels_last, in place. Not ``model.to(memory_format=...)``: that
    swaps the tensors, which fake ones (the planner's step) refuse; replacing ``.data`` keeps each
    Parameter object, so an optimizer or hook holding it still does."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last):
                t.data = t.data.contiguous(memory_format=torch.channels_last)


def apply_channels_last(model: nn.Module, weights: bool = True) -> bool:
    """Convert ``model``'s 4-D parameters and buffers to channels_last and its forward's 4-D floating
    inputs too (module docstring). ``weights=False`` (a strategy that shards contiguous parameters only,
    FSDP2's ``fully_shard``) converts the batch only: a convolution given a channels_last input computes
    channels_last and converts its weight itself, each call. A model without ``Conv2d`` is left alone with
    one info line (configs are shared between models): returns whether it was converted."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        logger.info(f"channels_last: {type(model).__name__} has no 2-D convolutions; left as it is")
        return False
    if weights:
        _weights_to_channels_last(model)
    preprocessor = getattr(model, "data_preprocessor", None)
    if isinstance(preprocessor, nn.Module):  # its batch is converted as it is made: the NCHW one is not kept
        preprocessor.register_forward_hook(_output_to_channels_last)
    else:
        model.register_forward_pre_hook(_inputs_to_channels_last, with_kwargs=True)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    if weights:
        logger.info(f"channels_last: the weights of {convs} convolutions and the model's 4-D inputs are "
                    "channels_last")
    else:
        logger.info(f"channels_last: the model's 4-D inputs are channels_last; the weights of its {convs} "
                    "convolutions stay contiguous for the strategy's sharding (each convolution converts its own)")
    return True
