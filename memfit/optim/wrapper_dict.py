"""OptimWrapperDict: several optimizers for one model (GAN-style), each an OptimWrapper, as MMEngine's.

A custom ``train_step`` steps each one itself (``optim_wrapper['generator'].update_params(loss)``);
the dict only groups them for the runner: learning rates for the log, state for checkpoints, the
schedulers (``param_scheduler`` as a dict keyed by the same names) and the strategy they share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from memfit.optim.wrapper import OptimWrapper
from memfit.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register()
class OptimWrapperDict(OptimWrapper):
    """``OptimWrapperDict(generator=OptimWrapper(...), discriminator=OptimWrapper(...))``."""

    def __init__(self, **optim_wrappers: OptimWrapper) -> None:  # noqa: D107 - no super().__init__: no optimizer
        for name, wrapper in optim_wrappers.items():
            if not isinstance(wrapper, OptimWrapper):
                raise TypeError(f"OptimWrapperDict takes OptimWrapper instances, got {name}={type(wrapper).__name__}")
        self.optim_wrappers = dict(optim_wrappers)
        self._strategy = None

    # The dict is not a wrapper: each step goes through one of its members (MMEngine raises the same).
    def update_params(self, loss: Any, step_kwargs: dict | None = None, zero_kwargs: dict | None = None) -> None:
        raise NotImplementedError("update_params should be called on each optimizer wrapper: optim_wrapper[name]")

    def backward(self, loss: Any, **kwargs: Any) -> None:
        raise NotImplementedError("backward should be called on each optimizer wrapper: optim_wrapper[name]")

    def step(self, **kwargs: Any) -> None:
        raise NotImplementedError("step should be called on each optimizer wrapper: optim_wrapper[name]")

    def zero_grad(self, **kwargs: Any) -> None:
        raise NotImplementedError("zero_grad should be called on each optimizer wrapper: optim_wrapper[name]")

    def optim_context(self, model: nn.Module) -> Any:
        raise NotImplementedError("optim_context should be called on each optimizer wrapper: optim_wrapper[name]")

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Nothing: each member counts its own micro-steps (as in MMEngine)."""

    @property
    def strategy(self) -> Any:
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: Any) -> None:
        self._strategy = strategy
        for wrapper in self.optim_wrappers.values():
            wrapper.strategy = strategy

    @property
    def inner_count(self) -> int:  # the runner checkpoints open windows per member, not here
        return 0

    @property
    def accumulative_counts(self) -> int:
        return 1

    @property
    def param_groups(self) -> dict[str, list[dict]]:  # type: ignore[override]
        return {name: w.param_groups for name, w in self.optim_wrappers.items()}

    def get_lr(self) -> dict[str, list[float]]:
        """``{'<name>.lr': [...], '<name>.base_lr': [...]}`` per member."""
        out: dict[str, list[float]] = {}
        for name, wrapper in self.optim_wrappers.items():
            lrs = wrapper.get_lr()
            if "base_lr" in lrs:
                out[f"{name}.base_lr"] = lrs["base_lr"]
            out[f"{name}.lr"] = lrs["lr"]
        return out

    def get_momentum(self) -> dict[str, list[float]]:
        return {f"{name}.momentum": w.get_momentum()["momentum"] for name, w in self.optim_wrappers.items()}

    def log_scalars(self) -> dict[str, Any]:
        return {f"{name}.{k}": v for name, w in self.optim_wrappers.items() for k, v in w.log_scalars().items()}

    def state_dict(self) -> dict:
        return {name: w.state_dict() for name, w in self.optim_wrappers.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, sub in state.items():
            self._member(name, "the state dict").load_state_dict(sub)

    def checkpoint_state(self, with_optimizer: bool = True) -> dict:
        return {name: w.checkpoint_state(with_optimizer) for name, w in self.optim_wrappers.items()}

    def load_checkpoint_state(self, state: dict) -> None:
        for name, sub in state.items():
            self._member(name, "the checkpoint").load_checkpoint_state(sub)

    def _member(self, name: str, where: str) -> OptimWrapper:
        if name not in self.optim_wrappers:
            raise KeyError(f"{where} has optimizer {name!r}, this OptimWrapperDict has {sorted(self.optim_wrappers)}")
        return self.optim_wrappers[name]

    # -- a mapping, as MMEngine's --------------------------------------------------------------
    def items(self) -> Iterator[tuple[str, OptimWrapper]]:
        yield from self.optim_wrappers.items()

    def keys(self) -> Iterator[str]:
        yield from self.optim_wrappers.keys()

    def values(self) -> Iterator[OptimWrapper]:
        yield from self.optim_wrappers.values()

    def __getitem__(self, name: str) -> OptimWrapper:
        if name not in self.optim_wrappers:
            raise KeyError(f"no optimizer wrapper {name!r}: this OptimWrapperDict has {sorted(self.optim_wrappers)}")
        return self.optim_wrappers[name]

    def __contains__(self, name: str) -> bool:
        return name in self.optim_wrappers

    def __len__(self) -> int:
        return len(self.optim_wrappers)

    def __repr__(self) -> str:
        return "OptimWrapperDict(" + ", ".join(f"{n}={w!r}" for n, w in self.optim_wrappers.items()) + ")"
