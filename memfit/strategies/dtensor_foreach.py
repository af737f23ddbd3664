"""A workaround for a quadratic step in DTensor's sharding propagation of foreach operators (torch 2.14).

An FSDP2 model's optimizer steps lists of DTensor parameters with foreach operators (``_foreach_mul_``,
``_foreach_addcdiv_``, ... for torch's default AdamW on CUDA; ``_foreach_norm`` for clipping). The first
time DTensor meets such a call it propagates its sharding per list element, and for each element
``torch.distributed.tensor._sharding_prop._propagate_use_strided_shard_flag`` walks every argument spec of
the whole call again: N elements x N specs. For DINO Swin-L's 637 parameters that is most of a 15 s first
optimizer step, in a real run and in each of the planner's FSDP fake steps.

The walk looks for ``_StridedShard`` placements, and does nothing when the call has none (FSDP2 on a 1-D
mesh shards with ``Shard(0)``). :func:`install` wraps the function so that the walk runs once per call, not
once per element: where the call has a ``_StridedShard`` the original runs, unchanged. Our own because torch
has no switch for it; remove it once torch fixes the loop.
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Wrap DTensor's ``_propagate_use_strided_shard_flag`` as the module docstring says (idempotent; a torch
    without it is left alone)."""
    global _installed
    if _installed:
        return
    try:
        from torch.distributed.tensor import _sharding_prop as prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return
    original = getattr(prop, "_propagate_use_strided_shard_flag", None)
    if original is None:
        return
    last: list[Any] = [None, False]  # the last call's schema, and whether any of its specs is strided

    def propagate_use_strided_shard_flag(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            last[0] = op_schema
            last[1] = any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements)
        if last[1]:
            propagate_use_strided_shard_flag.original(op_strategy, op_schema)

    propagate_use_strided_shard_flag.original = original  # type: ignore[attr-defined]
    prop._propagate_use_strided_shard_flag = propagate_use_strided_shard_flag
    _installed = True
