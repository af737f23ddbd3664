"""The BaseModel contract (MMEngine's): ``forward(*inputs, mode='loss'|'predict'|'tensor')``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``data`` with ``fn`` applied to every tensor in it, nested in dicts, lists, tuples and namedtuples
    (their types kept); anything else is returned as it is."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        if isinstance(data, OrderedDict):
            return OrderedDict((k, map_tensors(v, fn)) for k, v in data.items())
        return type(data)({k: map_tensors(v, fn) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    return data


def move_to(data: Any, device: torch.device | str | None, non_blocking: bool = False) -> Any:
    """Move every tensor in a nested dict/list/tuple to ``device`` (structure kept)."""
    if device is None:
        return data
    return map_tensors(data, lambda t: t.to(device, non_blocking=non_blocking))


class _FollowsDevice(nn.Module):
    """``.to()``/``.cuda()``/``.cpu()`` also tell every data preprocessor inside where batches go
    (MMEngine's BaseModel and BaseDataPreprocessor do this)."""

    def to(self, *args: Any, **kwargs: Any) -> nn.Module:
        _set_device(self, _parse_to_device(*args, **kwargs))
        return super().to(*args, **kwargs)

    def cuda(self, device: int | torch.device | None = None) -> nn.Module:
        _set_device(self, _cuda_device(device))
        return super().cuda(device)

    def cpu(self) -> nn.Module:
        _set_device(self, torch.device("cpu"))
        return super().cpu()


class BaseDataPreprocessor(_FollowsDevice):
    """Moves a batch to the model's device. Subclass to normalise, pad or augment on the device.

    ``device`` follows ``.to()``/``.cuda()``/``.cpu()`` of the preprocessor or of its BaseModel (as
    MMEngine's ``_device``); it starts on the CPU. ``non_blocking``: copy without waiting for the copy
    to finish; by default (None) on CUDA, where a pinned batch then overlaps the step's work (a copy
    to the host is never non-blocking: its reader would not wait)."""

    def __init__(self, non_blocking: bool | None = None) -> None:
        super().__init__()
        self.non_blocking = non_blocking
        self.device: torch.device = torch.device("cpu")

    def cast_data(self, data: Any) -> Any:
        """Every tensor in ``data`` on this preprocessor's device."""
        cuda = self.device.type == "cuda"
        return move_to(data, self.device, cuda and self.non_blocking is not False)

    def forward(self, data: Any, training: bool = False) -> Any:
        return self.cast_data(data)


def build_data_preprocessor(cfg: nn.Module | dict | None) -> nn.Module:
    """A model's ``data_preprocessor`` from a config dict, a module, or None (BaseDataPreprocessor)."""
    if isinstance(cfg, dict):
        from memfit.registry import MODELS

        return MODELS.build(cfg, key="data_preprocessor")
    if cfg is not None and not isinstance(cfg, nn.Module):
        raise TypeError(f"data_preprocessor should be a dict or an nn.Module instance, got {type(cfg).__name__}")
    return cfg or BaseDataPreprocessor()


class BaseModel(_FollowsDevice):
    """Base class for memfit models (MMEngine's contract).

    Subclasses implement ``forward(*inputs, mode)``: ``mode='loss'`` returns a dict of losses (each
    value whose key contains 'loss' is averaged and summed), ``'predict'`` returns predictions for the
    evaluator, ``'tensor'`` returns raw outputs. A batch that is a dict is passed by keyword, a
    tuple/list positionally.
    """

    def __init__(self, data_preprocessor: nn.Module | dict | None = None, init_cfg: Any = None) -> None:
        super().__init__()
        self.data_preprocessor = build_data_preprocessor(data_preprocessor)
        self.init_cfg = init_cfg

    def init_weights(self) -> None:
        """Apply ``init_cfg`` (this model's and its submodules'; see :mod:`memfit.model.init`). The
        runner calls it before training, as MMEngine's does; override to initialise otherwise."""
        from memfit.model.init import init_model_weights

        init_model_weights(self)

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        """Forward under the wrapper's context (autocast, no-sync), backward and step through it."""
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode="loss")
        parsed, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed)
        return log_vars

    def val_step(self, data: Any) -> Any:
        data = self.data_preprocessor(data, False)
        return self._run_forward(data, mode="predict")

    def test_step(self, data: Any) -> Any:
        return self.val_step(data)

    def parse_losses(self, losses: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum the mean of every entry whose key contains 'loss'; other entries are only logged.

        Returns detached tensors for logging (no host sync here: the logger converts them).
        """
        if not isinstance(losses, Mapping):
            raise TypeError(
                f"{type(self).__name__}.forward(mode='loss') must return a dict of losses, got "
                f"{type(losses).__name__}"
            )
        log_vars: dict[str, torch.Tensor] = OrderedDict()
        for name, value in losses.items():
            if isinstance(value, torch.Tensor):
                log_vars[name] = _mean(value)
            elif isinstance(value, Sequence) and value and all(isinstance(v, torch.Tensor) for v in value):
                log_vars[name] = _total([_mean(v) for v in value])
            else:
                raise TypeError(f"loss {name!r} is a {type(value).__name__}: return a tensor or a list of tensors")
        loss_terms = [v for k, v in log_vars.items() if "loss" in k]
        if not loss_terms:
            raise ValueError(f"{type(self).__name__}.forward(mode='loss') returned no key containing 'loss'")
        loss = _total(loss_terms)
        log_vars["loss"] = loss
        return loss, OrderedDict((k, v.detach()) for k, v in log_vars.items())

    def _run_forward(self, data: Any, mode: str) -> Any:
        if isinstance(data, Mapping):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        return self(data, mode=mode)

    def forward(self, *inputs: Any, mode: str = "tensor", **kwargs: Any) -> Any:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} must implement forward(..., mode)")


def _parse_to_device(*args: Any, **kwargs: Any) -> torch.device | None:
    device = torch._C._nn._parse_to(*args, **kwargs)[0]  # how nn.Module.to reads its arguments
    return None if device is None else torch.device(device)


def _cuda_device(device: int | torch.device | None) -> torch.device:
    return torch.device("cuda", device) if device is None or isinstance(device, int) else torch.device(device)


def _set_device(module: nn.Module, device: torch.device | None) -> None:
    if device is None:
        return
    for m in module.modules():
        if isinstance(m, BaseDataPreprocessor):
            m.device = device


# MMEngine's parse_losses takes ``.mean()`` of every value and ``sum()``s the terms (from 0). The same
# values without the extra ops on scalars: fewer kernels per step, and a shorter backward graph.
def _mean(value: torch.Tensor) -> torch.Tensor:
    return value if value.dim() == 0 else value.mean()


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
