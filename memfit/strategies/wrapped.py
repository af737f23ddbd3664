"""A BaseModel's train/val/test steps with the forward run through a backend's wrapper.

DeepSpeed's engine and colossalai's boosted model are not BaseModels: the loops' ``train_step`` must
still come from the user's model, but its forward has to pass through the wrapper, where autocast,
ZeRO-3 parameter gathering and gradient-reduction hooks happen. ``runner.model`` is this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


class StepThroughWrapper(nn.Module):
    """``wrapper`` runs the forward; ``inner`` (the BaseModel) preprocesses data and parses losses.
    ``prepare_inputs`` (optional) transforms the preprocessed batch before the forward."""

    def __init__(self, wrapper: nn.Module, inner: nn.Module,
                 prepare_inputs: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.prepare_inputs = prepare_inputs
        self._inner = [inner]  # a list: not registered twice as a submodule

    @property
    def module(self) -> nn.Module:
        return self._inner[0]

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, torch.Tensor]:
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, True)
            losses = self._run_forward(data, mode="loss")
        parsed, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed)
        return log_vars

    def val_step(self, data: Any) -> Any:
        data = self.module.data_preprocessor(data, False)
        return self._run_forward(data, mode="predict")

    def test_step(self, data: Any) -> Any:
        return self.val_step(data)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(*args, **kwargs)

    def _run_forward(self, data: Any, mode: str) -> Any:
        if self.prepare_inputs is not None:
            data = self.prepare_inputs(data)
        if isinstance(data, Mapping):
            return self.wrapper(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self.wrapper(*data, mode=mode)
        return self.wrapper(data, mode=mode)
