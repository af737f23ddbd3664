"""Efficient Conv-BN in eval mode: fold a frozen BatchNorm into its conv inside autograd.

A Conv followed by a BatchNorm in eval mode (or torchvision's ``FrozenBatchNorm2d``) is an affine
map of the conv output, so ``bn(conv(x, W, b)) == conv(x, W * c, b')`` with
``c = gamma / sqrt(running_var + eps)`` and ``b' = beta + (b - running_mean) * c``. Computing the
right-hand side with the fold *inside* autograd (the "tune mode" of You et al. 2023, "Efficient
ConvBN Blocks for Transfer Learning and Beyond"; MMCV's ``efficient_conv_bn_eval_forward``) keeps
gradients for the conv weight/bias and the BN affine parameters, but autograd no longer saves the
conv output for the BN's backward: one activation per pair is never stored.

Pairs are found per listed submodule: with ``torch.fx.symbolic_trace`` where the module traces
(a Conv node whose only user is a BN node, each module called exactly once); where it does not
(detectors, models with data-dependent control flow), the search recurses into the children, and a
module that still does not trace contributes (a) a Conv directly followed by a BN inside an
``nn.Sequential`` and (b) attribute pairs named ``convN``/``bnN`` (torchvision and MMDet ResNet
blocks), assumed to be applied as ``bnN(convN(x))`` because the forward cannot be inspected.

The conv's and the BN's ``forward`` are replaced on the instances (no module is added or renamed,
so ``state_dict`` keys are unchanged). The mode is read at every call: while the BN is in train
mode the plain conv -> BN path runs, so switching ``train()``/``eval()`` at runtime works.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from memfit.errors import ConfigError, did_you_mean

logger = logging.getLogger("memfit")

# Only modules whose forward is the stock torch one: a subclass with its own forward (timm's
# BatchNormAct2d adds an activation, StdConv2d standardises its weight) would compute something else.
_CONV_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward}
_BN_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward, FrozenBatchNorm2d.forward}
_MARK = "_memfit_conv_bn_eval"


def _is_conv(m: nn.Module) -> bool:
    return type(m).forward in _CONV_FORWARDS


def _is_bn(m: nn.Module) -> bool:
    # A BN that does not track running statistics normalises with batch statistics even in eval mode.
    return type(m).forward in _BN_FORWARDS and getattr(m, "running_var", None) is not None


def _fits(conv: nn.Module, bn: nn.Module) -> bool:
    return (
        _is_conv(conv) and _is_bn(bn) and conv.out_channels == bn.running_var.numel()
        and not getattr(conv, _MARK, False) and not getattr(bn, _MARK, False)
    )


def _folded(bn: nn.Module) -> bool:
    """True when the BN is an affine map (eval mode or frozen): the fold is exact."""
    return isinstance(bn, FrozenBatchNorm2d) or not bn.training


def _fold(conv: nn.Module, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W * c, b')`` in fp32, differentiable w.r.t. the conv and BN parameters.

    Written here rather than torch.nn.utils.fusion.fuse_conv_bn_weights, which returns detached
    nn.Parameters (no gradient to W, gamma, beta), or torch._inductor's compile-only pass. fp32 with
    autocast off: a bf16 ``rsqrt(var)`` would lose the scale.
    """
    with torch.autocast(conv.weight.device.type, enabled=False):
        var = bn.running_var.float()
        gamma = bn.weight.float() if bn.weight is not None else torch.ones_like(var)
        beta = bn.bias.float() if bn.bias is not None else torch.zeros_like(var)
        bias = conv.bias.float() if conv.bias is not None else torch.zeros_like(var)
        coeff = gamma * torch.rsqrt(var + bn.eps)
        weight = _ScaleRows.apply(conv.weight.float(), coeff)
        return weight, beta + (bias - bn.running_mean.float()) * coeff


class _ScaleRows(torch.autograd.Function):
    """``w * c`` per output channel, with a backward that allocates no weight-sized temporary.

    Autograd's ``mul`` backward would hold the incoming gradient and a new one for ``w`` together,
    and materialise ``g * w`` for ``c``'s gradient; here ``c``'s gradient is a batched dot product
    and ``w``'s gradient reuses the incoming buffer (the conv's freshly made weight gradient).
    """

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, c)
        return w * c.reshape(-1, *([1] * (w.dim() - 1)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        w, c = ctx.saved_tensors
        n = w.shape[0]
        gc = None
        if ctx.needs_input_grad[1]:
            gc = torch.bmm(g.reshape(n, 1, -1), w.reshape(n, -1, 1)).reshape(n)
        gw = None
        if ctx.needs_input_grad[0]:
            rows = c.reshape(-1, *([1] * (w.dim() - 1)))
            # In place only when nothing else can see ``g`` (no double backward, a plain dense buffer).
            inplace = not torch.is_grad_enabled() and g.is_contiguous() and g._base is None
            gw = g.mul_(rows) if inplace else g * rows
        return gw, gc


class _Refold:
    """What autograd stores instead of the folded weight: the recipe to compute it again.

    The conv's backward needs ``W * c`` for the input gradient. Saving it would keep a copy of every
    folded conv weight alive until backward (MMCV does: for small inputs that costs more than the
    conv outputs it saves); recomputing it is one elementwise multiply per conv.
    """

    def __init__(self, conv: nn.Module, bn: nn.Module, dtype: torch.dtype) -> None:
        self.conv, self.bn, self.dtype = conv, bn, dtype
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        return [t._version for t in (self.conv.weight, self.bn.weight, self.bn.running_var) if t is not None]

    def __call__(self) -> torch.Tensor:
        if self._versions() != self.versions:
            raise RuntimeError(
                "efficient_conv_bn_eval: a conv or BN tensor was modified in place between forward and "
                "backward, so the folded weight cannot be recomputed"
            )
        with torch.no_grad():
            return _fold(self.conv, self.bn)[0].to(self.dtype)


def _unpack(saved: object) -> torch.Tensor:
    return saved() if isinstance(saved, _Refold) else saved  # type: ignore[return-value]


def _conv_forward(conv: nn.Module, bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The conv's forward: ``conv(x, W*c, b')`` while the BN is folded, else the plain conv."""
    if not _folded(bn):
        return conv._conv_forward(x, conv.weight, conv.bias)
    weight, bias = _fold(conv, bn)
    device = x.device.type
    # Cast as autocast would for a conv, then run it with autocast off: the weight the conv saves
    # for backward is then this very tensor, which the pack hook below swaps for a recipe.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else conv.weight.dtype
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    ref = weakref.ref(weight)  # a strong reference in the hook would keep the copy alive

    def pack(t: torch.Tensor) -> object:
        return _Refold(conv, bn, dtype) if t is ref() else t

    with torch.autocast(device, enabled=False), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        return conv._conv_forward(x, weight, bias)


def _bn_forward(bn: nn.Module, forward: object, x: torch.Tensor) -> torch.Tensor:
    """The BN's forward: identity while folded into its conv, else the original BN."""
    return x if _folded(bn) else forward(x)  # type: ignore[operator]


class _Tracer(torch.fx.Tracer):
    """fx keeps only ``torch.nn`` modules as leaves; FrozenBatchNorm2d (torchvision) must be one too."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m).forward in _BN_FORWARDS or _is_conv(m) or super().is_leaf_module(m, qualname)


def _fx_pairs(module: nn.Module) -> list[tuple[nn.Module, nn.Module]] | None:
    """Conv -> BN pairs from an fx graph of ``module``; None when it does not trace."""
    try:
        graph = _Tracer().trace(module)
    except Exception:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
        return None
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue
        if calls[node.target] != 1 or calls[src.target] != 1:
            continue  # a module called twice would be folded at a call site that has no partner
        conv, bn = module.get_submodule(src.target), module.get_submodule(node.target)
        if _fits(conv, bn):
            pairs.append((conv, bn))
    return pairs


def _order_pairs(module: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Pairs in an untraceable module's direct children: Sequential order and convN/bnN names."""
    children = dict(module.named_children())
    pairs = []
    if isinstance(module, nn.Sequential):
        mods = list(children.values())
        pairs += [(a, b) for a, b in zip(mods, mods[1:]) if _fits(a, b)]
    else:
        for name, conv in children.items():
            m = re.fullmatch(r"conv(\d*)", name)
            bn = children.get(f"bn{m.group(1)}") if m else None
            if bn is not None and _fits(conv, bn):
                pairs.append((conv, bn))
    return pairs


def _has_candidates(module: nn.Module) -> bool:
    mods = list(module.modules())
    return any(_is_conv(m) for m in mods) and any(_is_bn(m) for m in mods)


def find_conv_bn_pairs(module: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Conv -> BN pairs of ``module`` (fx where it traces, else recurse; see the module docstring)."""
    if not _has_candidates(module):
        return []
    pairs = _fx_pairs(module)
    if pairs is not None:
        return pairs
    pairs = _order_pairs(module)
    for child in module.children():
        pairs += find_conv_bn_pairs(child)
    return pairs


def apply_efficient_conv_bn_eval(model: nn.Module, names: list[str]) -> int:
    """Fold every eval-mode BN into its conv inside autograd, in the submodules ``names``.

    ``names`` are qualified module names as in MMEngine's memory-saving guide's ``efficient_conv_bn_eval=['backbone']``
    (``''`` is the whole model). Returns the number of conv-BN pairs enabled (pairs enabled by an
    earlier call are not counted again). Gradients equal the unfused model's up to float rounding;
    BN layers in train mode are unaffected. Unknown names raise ConfigError with near matches.
    """
    if isinstance(names, str):
        names = [names]
    modules = dict(model.named_modules())
    total = 0
    for name in names:
        if name not in modules:
            near = did_you_mean(name, [n for n in modules if n])
            raise ConfigError(f"efficient_conv_bn_eval: no module named {name!r}: {near}")
        pairs = find_conv_bn_pairs(modules[name])
        for conv, bn in pairs:
            conv.forward = functools.partial(_conv_forward, conv, bn)
            bn.forward = functools.partial(_bn_forward, bn, bn.forward)
            setattr(conv, _MARK, True)
            setattr(bn, _MARK, True)
        where = name or "the model"
        logger.info(f"Enabling efficient_conv_bn_eval for {len(pairs)} conv-bn pairs in {where}")
        total += len(pairs)
    return total
