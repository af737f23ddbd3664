"""What DeepSpeed's whole-model ``fp16``/``bf16`` modes need around the engine (:mod:`memfit.strategies.deepspeed`):
the ``inputs_to_half`` of MMEngine's large-model training guide (cast chosen inputs to half) and BatchNorm
kept in fp32 with fp32 statistics."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError


def cast_inputs(data: Any, which: list | None = None, dtype: torch.dtype | None = None) -> Any:
    """The ``inputs_to_half`` of MMEngine's large-model training guide: cast the floating inputs at these
    positions (a tuple/list batch) or keys (a dict batch) to ``dtype``, as the whole-model half modes need."""
    if not which or dtype is None:
        return data

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    if isinstance(data, Mapping):
        missing = [k for k in which if k not in data]
        if missing:
            raise ConfigError(f"strategy.inputs_to_half={which!r}: the batch is a dict with keys {sorted(data)}; "
                              "name keys of it")
        return type(data)({k: cast(v) if k in which else v for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        bad = [i for i in which if not isinstance(i, int) or i >= len(data)]
        if bad:
            raise ConfigError(f"strategy.inputs_to_half={which!r}: the batch has {len(data)} positional inputs")
        return type(data)(cast(v) if i in which else v for i, v in enumerate(data))
    return cast(data) if 0 in which else data


def keep_batchnorm_fp32(model: nn.Module) -> list[str]:
    """In whole-model half mode, run BatchNorm in fp32 with fp32 running statistics (a bf16 running
    mean keeps 3 significant digits). The half weights are cast up inside autograd, so their
    gradients still reach the engine's half parameters. Returns the names of the layers changed."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for key in ("running_mean", "running_var"):
                buf = getattr(module, key, None)
                if buf is not None:
                    setattr(module, key, buf.float())
            module.forward = types.MethodType(_bn_forward_fp32, module)
            changed.append(name)
    return changed


def _bn_forward_fp32(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    # BatchNorm's own forward, with inputs and affine weights cast to fp32 (torch's CPU kernel does not
    # mix half weights with fp32 statistics) and the output cast back.
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            momentum = 1.0 / float(self.num_batches_tracked)
    use_batch = self.training or self.running_mean is None
    out = nn.functional.batch_norm(
        x.float(), self.running_mean if not self.training or self.track_running_stats else None,
        self.running_var if not self.training or self.track_running_stats else None,
        None if self.weight is None else self.weight.float(), None if self.bias is None else self.bias.float(),
        use_batch, momentum, self.eps)
    return out.to(x.dtype)
