"""Optimizer step in backward: update each parameter as soon as its gradient is ready, then free it.

torch's recipe ("How to save memory by fusing the optimizer step into the backward pass"): one
optimizer per parameter, stepped from ``Tensor.register_post_accumulate_grad_hook``, after which the
gradient is dropped, so at most a few gradients are ever alive instead of all of them. It changes
nothing numerically for element-wise optimizers (SGD, Adam(W), Lars per tensor), but it needs each
gradient exactly once and complete, which rules out gradient accumulation, gradient clipping by
global norm and fp16 loss scaling (unscale and the inf check need every gradient before any step),
and data-parallel training whose gradients are reduced after the hook fires (DDP, FSDP).

``OptimizerInBackward`` stands in for the optimizer everywhere else in the engine: LR schedulers
write ``param_groups`` (each per-parameter optimizer reads its group's options before it steps),
checkpoints use ``state_dict()``/``load_state_dict()`` in ``torch.optim``'s own format, and
``step()``/``zero_grad()`` do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from memfit.errors import ConfigError


def check_in_backward_compatible(
    accumulative_counts: int, clip_grad: Any, *, grad_scaler: Any = None
) -> None:
    """Raise ConfigError if ``optimizer_in_backward`` is combined with a feature needing all gradients."""
    fixes = []
    if accumulative_counts != 1:
        fixes.append("set accumulative_counts=1")
    if clip_grad:
        fixes.append("remove clip_grad")
    if grad_scaler is not None:
        fixes.append("use bfloat16 instead of float16 (no GradScaler)")
    if fixes:
        raise ConfigError(
            "optimizer_in_backward needs every gradient once and steps it at once (no accumulation, "
            f"no global-norm clipping, no loss scaling): {' / '.join(fixes)}"
        )


class OptimizerInBackward(Optimizer):
    """One ``optimizer_factory([param])`` per parameter, stepped inside backward (module doc).

    ``params`` is what a torch optimizer takes: tensors or group dicts (e.g. from
    ``build_param_groups``); a group's options override the factory's defaults for its parameters.
    ``optimizer_factory`` is a callable taking a param-group list, e.g.
    ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
    """

    def __init__(self, params: Iterable[Any], optimizer_factory: Callable[..., Optimizer]) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.optimizer_factory = optimizer_factory
        self.optimizers: dict[torch.Tensor, Optimizer] = {}
        defaults = None
        for group in groups:
            opts = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            for p in group["params"]:
                inner = optimizer_factory([{**opts, "params": [p]}])
                self.optimizers[p] = inner
                defaults = defaults or inner.defaults
        if defaults is None:
            raise ConfigError("optimizer_in_backward: the optimizer got no parameters")
        # The outer groups get the resolved defaults (an explicit lr, betas, ...) exactly as the
        # wrapped optimizer class would fill them; schedulers read and write these.
        super().__init__(groups, dict(defaults))
        self._owner: dict[torch.Tensor, int] = {}
        self._handles = []
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._owner[p] = i
                self._handles.append(p.register_post_accumulate_grad_hook(self._step_param))
        self._link_state()

    def _link_state(self) -> None:
        """Make ``self.state[p]`` the very dict the per-parameter optimizer updates."""
        for p, inner in self.optimizers.items():
            if p in self.state:
                inner.state[p] = self.state[p]
            else:
                self.state[p] = inner.state[p]

    def _step_param(self, p: torch.Tensor) -> None:
        inner = self.optimizers[p]
        # Read the (maybe scheduled) options from the outer group: the "view" a scheduler writes to.
        group = self.param_groups[self._owner[p]]
        inner.param_groups[0].update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        inner.step()
        p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Nothing to do: every parameter was stepped in backward. Runs ``closure`` if given."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed right after its step."""

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` format; parameters that never stepped have no entry, as in torch."""
        sd = super().state_dict()
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict replaced self.state (new dicts) and the group dicts.
        for p, inner in self.optimizers.items():
            inner.state.pop(p, None)
        self._link_state()

    def remove_hooks(self) -> None:
        """Detach from the parameters (e.g. before switching back to a normal optimizer)."""
        for h in self._handles:
            h.remove()
        self._handles = []
