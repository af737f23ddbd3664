"""Which modules FSDPStrategy shards as units (:mod:`memfit.strategies.fsdp`): named modules or classes
(``wrap_modules``), an FSDP1 auto-wrap policy evaluated over the tree as FSDP1 would, or by default the
model's repeated block types."""

from __future__ import annotations

from typing import Any

from torch import nn

from memfit.errors import ConfigError, did_you_mean
from memfit.model.blocks import CONTAINERS


def select_units(model: nn.Module, wrap_modules: list[Any] | None = None,
                 auto_wrap_policy: Any = None) -> dict[str, nn.Module]:
    """The modules (by name, root excluded) to shard as FSDP units; see the module docstring."""
    named = dict(model.named_modules())
    if wrap_modules is not None:
        units: dict[str, nn.Module] = {}
        for spec in wrap_modules:
            hits = {n: m for n, m in named.items() if _matches(n, m, spec)}
            if not hits:
                kinds = sorted({type(m).__name__ for m in named.values()})
                raise ConfigError(f"FSDPStrategy.wrap_modules: {spec!r} matches no module: "
                                  f"{did_you_mean(str(spec), [n for n in named if n] + kinds)}")
            units.update(hits)
    elif auto_wrap_policy is not None:
        units = _run_policy(model, auto_wrap_policy)
    else:
        units = repeated_blocks(model)
    units.pop("", None)
    return units


def _matches(name: str, module: nn.Module, spec: Any) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return spec == name or spec == type(module).__name__


def repeated_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost modules whose class (not a container) occurs at least twice in ``model`` and that
    hold parameters; composite ones (with children holding parameters) only, when there are any.

    Leaf layers (Linear, LayerNorm, Embedding) repeat in every model: as units they would make one
    all-gather per layer, and a parameter a model reads directly (DINO's ``query_embedding.weight``)
    would stay sharded outside its unit's forward. They stay in their parent's unit unless the model
    has no composite block at all (a stack of Linears).
    """
    counts: dict[type, int] = {}
    for _, m in model.named_modules():
        counts[type(m)] = counts.get(type(m), 0) + 1

    def pick(composite_only: bool) -> dict[str, nn.Module]:
        units: dict[str, nn.Module] = {}
        for name, m in model.named_modules():
            if not name or counts[type(m)] < 2 or isinstance(m, CONTAINERS) or next(m.parameters(), None) is None:
                continue
            if composite_only and not any(next(c.parameters(), None) is not None for c in m.children()):
                continue
            if any(name.startswith(f"{u}.") for u in units):
                continue  # inside a unit already chosen (named_modules is pre-order: outer first)
            units[name] = m
        return units

    return pick(composite_only=True) or pick(composite_only=False)


def _run_policy(model: nn.Module, policy: Any) -> dict[str, nn.Module]:
    """Evaluate an FSDP1 auto-wrap policy over the tree, as FSDP1's ``_recursive_wrap`` does."""
    names = {m: n for n, m in model.named_modules()}
    if hasattr(policy, "_run_policy"):  # ModuleWrapPolicy, CustomPolicy, ... (FSDP1 _Policy objects)
        chosen = policy._run_policy(model, set(), {})
        return {names[m]: m for m in chosen if m in names}
    units: dict[str, nn.Module] = {}

    def visit(module: nn.Module) -> int:
        """Wrap qualifying descendants of ``module``; return its parameter count not yet wrapped."""
        total = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return total
        wrapped = 0
        for child in module.children():
            remaining = visit(child)
            wrapped += sum(p.numel() for p in child.parameters()) - remaining
        remaining = total - wrapped
        if module is not model and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            units[names[module]] = module
            return 0
        return remaining

    visit(model)
    return units
