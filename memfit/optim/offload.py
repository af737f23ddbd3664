"""Optimizer offload: the optimizer's state and step live in host memory (ZeRO-Offload's split).

``cfg=dict(optimizer_offload=True)`` (or the top-level key). The device keeps the parameters the
model computes with and their gradients; the host keeps an fp32 copy of each parameter (of this
rank's shard under FSDP), the optimizer state, and runs the step. Each optimizer step copies the
parameters and gradients to the host, steps there, and copies the updated parameters back. The
device saves the optimizer state (AdamW: 8 bytes per parameter) and the step's temporaries; it pays
three copies of the parameters' size over the host link and a step on the host CPU.

Why memfit's own: torchao's ``CPUOffloadOptimizer`` copies each gradient inside backward, before
the optimizer wrapper unscales (fp16) and clips it by its global norm, runs on CUDA only, and saves
a state dict of its own layout (one optimizer per parameter) that ``torch.distributed.checkpoint``
cannot reshard; FSDP2's ``CPUOffloadPolicy`` moves the parameters and gradients too; DeepSpeed's
ZeRO-Offload is DeepSpeedStrategy's ``zero_optimization.offload_optimizer``.

:class:`OffloadedOptimizer` stands in for the optimizer everywhere: ``param_groups`` hold the model's
(device, maybe DTensor) parameters, so LR schedulers, the GradScaler's unscale, gradient clipping
and ``zero_grad`` act on the device as before, and the host optimizer reads the groups' options
before each step; ``state`` and ``state_dict()`` are in ``torch.optim``'s format over those
parameters (the tensors on the host), so checkpoints, ``torch.distributed.checkpoint`` and a resume
with or without offload read them alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from memfit.errors import ConfigError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

HOST = torch.device("cpu")


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s memory on this rank (a DTensor's local shard)."""
    return t._local_tensor if _is_dtensor(t) else t


def _like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``template``'s kind: a DTensor of the same layout, or itself."""
    if not _is_dtensor(template):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def _to_host(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``t`` (its local shard) in host memory. From a GPU the copy is asynchronous into pinned memory;
    on a CPU run ``t`` itself unless ``copy``."""
    local = _local(t)
    return _like(local.to(HOST, non_blocking=local.device.type != "cpu", copy=copy), t)


class OffloadedOptimizer(Optimizer):
    """``optimizer_factory`` built over host copies of ``params``, stepped on the host (module doc).

    ``params``: tensors or group dicts, as a torch optimizer takes them; ``optimizer_factory``: a
    callable taking a param-group list, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
    """

    host_resident = True  # the memory tracker files this optimizer's state and copies under "host"

    def __init__(self, params: Iterable[Any], optimizer_factory: Callable[..., Optimizer]) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        if not any(list(g["params"]) for g in groups):
            raise ConfigError("optimizer_offload: the optimizer got no parameters")
        with torch.no_grad():
            host_groups = [{**g, "params": [_to_host(p, copy=True) for p in g["params"]]} for g in groups]
        self.host_optimizer = optimizer_factory(host_groups)
        self.host_optimizer.host_resident = True
        super().__init__([dict(g, params=list(g["params"])) for g in groups], dict(self.host_optimizer.defaults))
        # The outer groups carry the options exactly as the host optimizer resolved them.
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups):
            group.update(_options(host_group))

    def _pairs(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Each device parameter with its host copy (a distinct tensor, also on a CPU run)."""
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups):
            yield from zip(group["params"], host_group["params"])

    def _sync_device(self) -> None:
        """Wait for the copies issued so far (pinned host memory is written asynchronously)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def _link_state(self) -> None:
        """Make ``self.state[p]`` the very dict the host optimizer keeps for ``p``'s host copy."""
        self.state = defaultdict(dict)
        for p, h in self._pairs():
            if h in self.host_optimizer.state:
                self.state[p] = self.host_optimizer.state[h]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Copy the parameters and gradients to the host, step there, copy the parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups):
            host_group.update(_options(group))  # what a scheduler wrote
        for p, h in self._pairs():
            # The device parameters are the truth: a checkpoint's or load_from's weights may have been
            # written since the last step, and nothing reliable (not even the version counter, which
            # torch.distributed.checkpoint's in-place loads do not bump) says so. One more copy of the
            # parameters' size over the link keeps the host copy exact.
            _local(h).copy_(_local(p), non_blocking=True)
            h.grad = None if p.grad is None else _to_host(p.grad)
        self._sync_device()
        self.host_optimizer.step()
        for p, h in self._pairs():
            _local(p).copy_(_local(h), non_blocking=True)
            h.grad = None
        self._sync_device()
        self._link_state()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s format over the device parameters; state tensors stay on the host."""
        self._link_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the host optimizer (so the state lands on the host, not on the device) and the
        options into the outer groups; the layout is ``state_dict()``'s, offloaded or not."""
        self.host_optimizer.load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(_options(saved))
        self._link_state()


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
