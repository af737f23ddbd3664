"""A model's repeated blocks: the unit that activation checkpointing, FSDP sharding and regional
``torch.compile`` act on (a Swin or ViT block, a ResNet bottleneck, a detector's encoder layer)."""

from __future__ import annotations

from torch import nn

# Containers repeat in any model (stages are Sequentials) without being a block type.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def find_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's blocks: instances of repeated composite module types (not containers, holding
    parameters, with children of their own) none of whose instances holds two or more instances of
    one repeated composite type (that would make it a stage: Swin's SwinTransformerStage holds
    SwinTransformerBlocks; a block holds one attention and one MLP), and at least half as many as the
    most numerous such type. Outermost first; empty when nothing repeats."""
    named = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, CONTAINERS)
             and next(m.children(), None) is not None and next(m.parameters(), None) is not None]
    counts: dict[type, int] = {}
    for _, m in named:
        counts[type(m)] = counts.get(type(m), 0) + 1
    repeated = {t for t, c in counts.items() if c > 1}

    def holds_repeats(m: nn.Module) -> bool:
        inside: dict[type, int] = {}
        for sub in list(m.modules())[1:]:
            if type(sub) in repeated:
                inside[type(sub)] = inside.get(type(sub), 0) + 1
        return any(c > 1 for c in inside.values())

    block_types = {t for t in repeated if not any(holds_repeats(m) for _, m in named if type(m) is t)}
    most = max((counts[t] for t in block_types), default=0)
    block_types = {t for t in block_types if 2 * counts[t] >= most}  # not Swin's 3 PatchMergings beside 24 blocks
    out: dict[str, nn.Module] = {}
    for n, m in named:
        if type(m) in block_types and not any(n.startswith(f"{b}.") for b in out):
            out[n] = m
    return out
