"""The fake step's operator counter: operators, FLOPs (torch.utils.flop_counter's formulas, plus the CPU's fused
attention, which torch's counter has none of), bytes written by FLOP-less operators and collective bytes by kind:
what :mod:`memfit.planner.cost` times a plan's step from."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# Collectives by kind: an all-gather's traffic is its output, a reduce-scatter's its input.
_GATHER = ("all_gather", "allgather", "_allgather_base")
_REDUCE = ("reduce_scatter", "all_reduce", "allreduce", "_reduce_scatter_base")
_BROADCAST = ("broadcast",)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default,
          torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.expand.default,
          torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default, torch.ops.aten.detach.default,
          torch.ops.aten.alias.default}


def _cpu_attention_flops() -> dict[Any, Any]:
    """FLOP formulas for the CPU's fused attention (what ``scaled_dot_product_attention`` dispatches on the fake
    step's CPU tensors), which torch's counter has none of: those of its CUDA twins (flash attention's)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}

    def forward(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


class OpCounter:
    """Counts operators, FLOPs (torch.utils.flop_counter's formulas) and collective bytes by kind, as the
    tracker's observer: it sees the operators the tracker counts (local tensors, not DTensor's wrappers
    or its shape propagation), with no dispatch layer of its own."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry

        self.registry = {**flop_registry, **_cpu_attention_flops()}
        self.flops = 0
        self.conv_flops = 0  # of ``flops``: convolutions forward and backward (channels_last, cuDNN's benchmark)
        self.attn_flops = 0  # of ``flops``: fused attention (scaled_dot_product_attention), forward and backward
        self.ops = 0
        self.written = 0  # bytes written by operators without a FLOP formula: memory-bound elementwise work
        self.comm = {"gather": 0, "reduce": 0, "broadcast": 0}
        self.counting = True
        self.in_step = 0  # the optimizer's step is costed apart (cost.py): its ops are not the model's
        self.step_ops = 0
        self._handles: list[Any] = []

    def _step(self, delta: int) -> None:
        self.in_step += delta

    def __enter__(self) -> OpCounter:
        self._handles = [register_optimizer_step_pre_hook(lambda *a: self._step(1)),
                         register_optimizer_step_post_hook(lambda *a: self._step(-1))]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if not self.counting:
            return
        if func.namespace not in ("c10d", "_c10d_functional"):
            self.step_ops += bool(self.in_step)
            if not self.in_step:
                self.ops += 1
                packet = func._overloadpacket
                if packet in self.registry:
                    flops = self.registry[packet](*args, **(kwargs or {}), out_val=out)
                    self.flops += flops
                    if "conv" in packet.__name__:
                        self.conv_flops += flops
                    elif "scaled_dot_product" in packet.__name__:
                        self.attn_flops += flops
                elif isinstance(out, torch.Tensor) and func not in _VIEWS:
                    self.written += out.numel() * out.element_size()
                elif func.namespace == "memfit":  # memfit's kernels (a backward returns several gradients)
                    self.written += sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out)
                                        if isinstance(t, torch.Tensor))
            return
        name = func.__name__
        kind = next((k for k, names in (("gather", _GATHER), ("reduce", _REDUCE), ("broadcast", _BROADCAST))
                     if any(n in name for n in names)), None)
        if kind is not None:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
            self.comm[kind] += max((t.numel() * t.element_size() for t in tensors), default=0)
