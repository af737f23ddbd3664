"""Activation checkpointing: by module name, by module type, every N-th block, selective (op-level), or
an ``nn.Sequential`` split into N segments.

``apply_activation_checkpointing(model, ['backbone.layers.0'])`` is MMEngine's
memory-saving guide's ``cfg=dict(activation_checkpointing=[...])``; the dict form adds
``dict(names=[...], types=['SwinTransformerBlock'], every_n=2, selective=True)``, and
``dict(splits=N, module='trunk')`` (VISSL's ``NUM_ACTIVATION_CHECKPOINTING_SPLITS``) runs a
Sequential's children as ``torch.utils.checkpoint.checkpoint_sequential`` does.

Each chosen module keeps its identity: only its ``forward`` is replaced, by an instance attribute
that runs the original forward under non-reentrant ``torch.utils.checkpoint.checkpoint``. Parameter
names, ``state_dict`` keys and module hooks stay as they were, so FSDP2 ``fully_shard`` or DDP
applied afterwards see the same module tree (torchtitan's ``checkpoint_wrapper`` inserts a wrapper
module and renames every parameter, which breaks checkpoints saved without it).

Non-reentrant checkpointing is what fixes MMEngine's two failures: a checkpointed region whose
inputs need no gradient (a whole ``backbone`` fed with images, or its first layer) still records
its parameters in the autograd graph, so it neither crashes ("element 0 of tensors does not require
grad") nor silently leaves ``conv1`` untrained.

A module is never checkpointed twice: modules inside (or around) one we already wrapped, and
modules covered by the model's own switch (timm's ``set_grad_checkpointing``, ``with_cp``,
``gradient_checkpointing``) are skipped with a warning, so every block recomputes its forward once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import ConfigError, did_you_mean
from memfit.memory.wrapping import WrappedForward, install, resolve_modules

logger = logging.getLogger("memfit")

SPEC_KEYS = ("names", "types", "every_n", "selective", "splits", "module")

# Selective checkpointing keeps the outputs of these ops (the expensive ones: GEMMs and attention)
# and recomputes everything else (norms, activations, adds), as torchtitan's op-level policy does.
DEFAULT_SAVE_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)

class _RecomputeContext:
    """The context a region's recomputation runs in: the selective policy's (if any), with every
    train-mode BatchNorm of the region leaving its running statistics and ``num_batches_tracked``
    as the first forward left them (momentum 0: ``(1 - 0) * running + 0 * batch`` is exact), so a
    recomputed BatchNorm is not counted twice. The kernels and saved tensors stay the same."""

    def __init__(self, inner: Any, norms: list[nn.Module]) -> None:
        self.inner, self.norms = inner, norms
        self.saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        # Outside the selective policy's mode: these copies are not ops of the region.
        self.saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
                      for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)
        for m, (momentum, count) in zip(self.norms, self.saved):
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)


def checkpoint_kwargs(regions: Iterable[nn.Module], context_fn: Callable[[], Any] | None) -> dict[str, Any]:
    """``checkpoint``'s ``context_fn`` for a region made of ``regions``: the selective contexts and the
    running-statistics guard of :class:`_RecomputeContext`; empty when neither applies.

    Under ``torch.compile`` (a compiled block traces its checkpoint) the guard is left out: the compiled
    backward recomputes from the traced graph, whose running-statistics update runs in the forward only
    (and dynamo traces only the selective contexts)."""
    if torch.compiler.is_compiling():
        return {"context_fn": context_fn} if context_fn is not None else {}
    norms = [m for r in regions for m in r.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    if not norms:
        return {"context_fn": context_fn} if context_fn is not None else {}

    def contexts() -> tuple[Any, Any]:
        fwd, rec = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        return fwd, _RecomputeContext(rec, norms)

    return {"context_fn": contexts}


class CheckpointedForward(WrappedForward):
    """``forward`` under non-reentrant checkpointing; selective when a context_fn is given."""

    kind = "activation checkpointing"

    def __init__(self, orig: Callable[..., Any], context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__(orig)
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to recompute
            return self.orig(*args, **kwargs)
        # kwargs go through a closure so that a keyword named like one of checkpoint's own
        # (context_fn, debug, ...) cannot collide; non-reentrant checkpointing differentiates
        # through tensors a closure captures.
        fn = partial(self.orig, **kwargs) if kwargs else self.orig
        module = getattr(self.orig, "__self__", None)
        regions = [module] if isinstance(module, nn.Module) else []
        return checkpoint(fn, *args, use_reentrant=False, **checkpoint_kwargs(regions, self.context_fn))


def _run_segment(children: list[nn.Module], checkpointed: bool = False) -> Callable[[Any], Any]:
    # A checkpointed segment keeps its input to recompute from; a first child that works in place
    # (torchvision's ReLU(inplace=True)) would overwrite it, so such a segment starts from a copy
    # (a temporary of the region: freed after its forward, made again when it is recomputed).
    copy_first = checkpointed and bool(children) and getattr(children[0], "inplace", False) is True

    def run(x: Any) -> Any:
        if copy_first and isinstance(x, torch.Tensor):
            x = x.clone()
        for child in children:
            x = child(x)
        return x

    return run


class SplitCheckpointedForward(WrappedForward):
    """An ``nn.Sequential``'s ``forward`` cut into ``segments`` as ``torch.utils.checkpoint.checkpoint_sequential``.

    The same loop and boundaries as torch's function: ``len(children) // segments`` children per
    segment, the remainder in the last one, and the last segment runs *without* checkpointing (its
    activations are needed by the backward right away), so ``segments=N`` checkpoints N - 1 regions
    and recomputes the first ``(N - 1) * (len // N)`` children once per backward. Each region goes
    through ``checkpoint(..., use_reentrant=False)`` itself (rather than ``checkpoint_sequential``,
    which takes no ``context_fn``) so train-mode BatchNorms are not updated twice (:func:`checkpoint_kwargs`).
    """

    kind = "activation checkpointing"

    def __init__(self, orig: Callable[..., Any], segments: int) -> None:
        super().__init__(orig)
        self.segments = segments

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or len(args) != 1 or kwargs:
            return self.orig(*args, **kwargs)  # nn.Sequential.forward raises for the odd signatures
        # The bound original forward's module: a deepcopy of the model copies it with its module.
        children = list(self.orig.__self__.children())
        size, x, end = len(children) // self.segments, args[0], -1
        for start in range(0, size * (self.segments - 1), size):
            end = start + size - 1
            segment = children[start:end + 1]
            x = checkpoint(_run_segment(segment, checkpointed=True), x, use_reentrant=False,
                           **checkpoint_kwargs(segment, None))
        return _run_segment(children[end + 1:])(x)


def resolve_ops(names: Iterable[Any]) -> set[Any]:
    """The aten op overloads named by ``names`` (``'mm'``, ``'aten.addmm.default'``, or op objects)."""
    ops: set[Any] = set()
    for name in names:
        if isinstance(name, torch._ops.OpOverload):
            ops.add(name)
            continue
        if isinstance(name, torch._ops.OpOverloadPacket):
            packet = name
        else:
            parts = str(name).removeprefix("aten.").split(".")
            packet = getattr(torch.ops.aten, parts[0], None)
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                raise ConfigError(
                    f"activation_checkpointing.selective.save_ops: unknown aten op {name!r} "
                    f"(examples: 'mm', 'aten.addmm', 'convolution')"
                )
            if len(parts) > 1:
                ops.add(getattr(packet, parts[1]))
                continue
        ops.update(getattr(packet, o) for o in packet.overloads())
    return ops


def selective_context_fn(save_ops: Iterable[Any] = DEFAULT_SAVE_OPS) -> Callable[[], Any]:
    """A ``context_fn`` for ``checkpoint`` that saves the outputs of ``save_ops`` and recomputes the rest.

    Ops are aten names (``'mm'``, ``'aten.addmm.default'``) or op objects.
    """
    save = resolve_ops(save_ops)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def _normalise(spec: Any) -> dict[str, Any]:
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        return {"names": list(spec)}
    if not isinstance(spec, dict):
        raise ConfigError(
            f"activation_checkpointing must be a list of module names or a dict(names=..., types=..., "
            f"every_n=..., selective=..., splits=..., module=...), got {type(spec).__name__}"
        )
    for k in spec:
        if k not in SPEC_KEYS:
            raise ConfigError(f"activation_checkpointing: unknown key {k!r}: {did_you_mean(k, SPEC_KEYS)}")
    return dict(spec)


def _match_types(model: nn.Module, types: Iterable[Any]) -> list[tuple[str, nn.Module]]:
    types = list(types)
    present = {type(m).__name__ for m in model.modules()}
    for t in types:
        if isinstance(t, str) and t not in present:
            raise ConfigError(
                f"activation_checkpointing.types: the model has no module of type {t!r}: "
                f"{did_you_mean(t, present)}"
            )
        if not isinstance(t, (str, type)):
            raise ConfigError(f"activation_checkpointing.types: expected class names or classes, got {t!r}")

    def matches(m: nn.Module) -> bool:
        return any(type(m).__name__ == t if isinstance(t, str) else isinstance(m, t) for t in types)

    return [(n, m) for n, m in model.named_modules() if matches(m)]


def _split_target(model: nn.Module, spec: dict[str, Any]) -> tuple[str, nn.Module, int] | None:
    """``splits=N, module='trunk'``: the Sequential to split and N, checked; None without ``splits``."""
    splits, name = spec.get("splits"), spec.get("module")
    if splits is None:
        if name is not None:
            raise ConfigError("activation_checkpointing.module needs splits=N (the number of segments to cut it into)")
        return None
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ConfigError(f"activation_checkpointing.splits must be a positive integer, got {splits!r}")
    if spec.get("selective"):
        raise ConfigError("activation_checkpointing: splits and selective do not combine (checkpoint_sequential "
                          "recomputes whole segments); use one of them")
    name = name or ""
    if not isinstance(name, str):
        raise ConfigError(f"activation_checkpointing.module must be a dotted module name, got {name!r}")
    ((name, module),) = resolve_modules(model, [name], "activation_checkpointing.module")
    shown = repr(name) if name else "the model"
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        hint = "" if name else " (set module='...' to one inside it)"
        raise ConfigError(f"activation_checkpointing.module: {shown} is a {type(module).__name__}, not an "
                          f"nn.Sequential running its children in order: splits need one{hint}")
    if splits > len(module):
        raise ConfigError(f"activation_checkpointing.splits={splits}: {shown} has only {len(module)} children; "
                          f"use splits <= {len(module)}")
    if splits == 1:
        logger.warning(f"activation_checkpointing: splits=1 checkpoints nothing in {shown}: as "
                       "checkpoint_sequential, the last segment runs without checkpointing")
    return name, module, splits


def apply_activation_checkpointing(model: nn.Module, spec: Any) -> list[str]:
    """Checkpoint the modules ``spec`` selects and return their qualified names.

    ``spec`` is a list of module names, or ``dict(names=[...], types=[...], every_n=N,
    selective=True | dict(save_ops=[...]))``: modules matching a name or a type (in
    ``named_modules()`` order) are chosen, ``every_n`` keeps the N-th, 2N-th, ... of them (as
    torchtitan's ``ac_freq``), and ``selective`` saves GEMM/attention outputs inside each region
    instead of recomputing everything. ``dict(splits=N, module='trunk')`` cuts the ``nn.Sequential``
    ``trunk`` (default: the model itself) into N segments as ``checkpoint_sequential`` does and
    checkpoints all but the last; names/types may be given too, for other modules. Trades compute
    (about one extra forward of the region) for the activation memory the region would have saved
    for backward.
    """
    spec = _normalise(spec)
    names = spec.get("names") or []
    types = spec.get("types") or []
    if isinstance(names, str):
        names = [names]
    if isinstance(types, (str, type)):
        types = [types]
    every_n = spec.get("every_n", 1)
    if not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1:
        raise ConfigError(f"activation_checkpointing.every_n must be a positive integer, got {every_n!r}")
    selective = spec.get("selective", False)
    split = _split_target(model, spec)
    if set(spec) - {"names"} and not names and not types and split is None:
        raise ConfigError("activation_checkpointing: the dict form needs names=[...] or types=[...] (or splits=N)")

    chosen = dict(resolve_modules(model, names, "activation_checkpointing.names"))
    chosen.update(_match_types(model, types))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    ordered = sorted(chosen.items(), key=lambda nm: order[nm[0]])
    ordered = [nm for i, nm in enumerate(ordered, start=1) if i % every_n == 0]

    context_fn = None
    if selective:
        if isinstance(selective, dict):
            unknown = [k for k in selective if k != "save_ops"]
            if unknown:
                raise ConfigError(
                    f"activation_checkpointing.selective: unknown key {unknown[0]!r} (valid: 'save_ops')"
                )
            context_fn = selective_context_fn(selective.get("save_ops", DEFAULT_SAVE_OPS))
        elif selective is True:
            context_fn = selective_context_fn()
        else:
            raise ConfigError(
                f"activation_checkpointing.selective must be True or dict(save_ops=[...]), got {selective!r}"
            )
    make = partial(CheckpointedForward, context_fn=context_fn)
    makers = {}
    if split is not None:
        name, module, splits = split
        ordered = [nm for nm in ordered if nm[0] != name] + [(name, module)]
        makers[name] = partial(SplitCheckpointedForward, segments=splits)
    done = install(model, ordered, make, "activation_checkpointing", makers)
    if done:
        mode = "selective " if context_fn else ""
        logger.info(f"{mode}activation checkpointing on {len(done)} modules: {', '.join(done)}")
    if split is not None and split[0] in done:
        name, module, splits = split
        size = len(module) // splits
        logger.info(f"activation checkpointing: {name or '<model>'} split into {splits} segments of {size} children "
                    f"({(splits - 1) * size} of {len(module)} checkpointed; the last segment runs plainly)")
    return done
