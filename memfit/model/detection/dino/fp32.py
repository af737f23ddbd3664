"""fp32 islands: regions of DINO that run with autocast off, so bf16/fp16 AMP trains stably."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def fp32_island(device: torch.device) -> Any:
    """A context with autocast off on ``device`` (a no-op on devices autocast does not know, e.g. meta).

    Inside it, cast inputs with ``.float()``: the deformable sampling, the matching costs and the losses
    then run in fp32 whatever the surrounding autocast dtype.
    """
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)
