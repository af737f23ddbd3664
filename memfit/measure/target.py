"""The device a step is measured for, where it differs from the tensors' own.

The planner runs a CUDA step on fake CPU tensors (fake CUDA tensors cannot run backward without a GPU).
Code that picks an implementation by device (a CUDA kernel where it runs on CUDA, PyTorch elsewhere) asks
:func:`device_type_of` instead of ``tensor.device.type``, so the fake step takes the path the GPU will::

    with measured_for("cuda"):          # the planner, around a fake step planned for a GPU
        ...
    device_type_of(x)                   # "cuda" inside, x.device.type outside
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_TARGET: ContextVar[str | None] = ContextVar("memfit_measured_for", default=None)


@contextlib.contextmanager
def measured_for(device_type: str | None) -> Iterator[None]:
    """Inside, :func:`device_type_of` answers ``device_type`` (``None``: the tensors' own device)."""
    token = _TARGET.set(device_type)
    try:
        yield
    finally:
        _TARGET.reset(token)


def device_type_of(tensor: torch.Tensor) -> str:
    """The device type the computation on ``tensor`` is for: the measured-for device, else its own."""
    return _TARGET.get() or tensor.device.type
