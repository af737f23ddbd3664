"""memfit/strategies/dtensor_foreach.py: DTensor's foreach sharding propagation without the per-element walk
of every argument spec, and the same result (fake process group of 4 ranks, CPU tensors)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import _sharding_prop as prop
from torch.distributed.tensor.placement_types import _StridedShard

from memfit.planner.fake import fake_process_group
from memfit.strategies import dtensor_foreach


def _lists(mesh, placement, n: int = 6):
    make = lambda i: DTensor.from_local(torch.full((2, 3), float(i)), mesh, [placement])  # noqa: E731
    return [make(i) for i in range(n)], [make(10 + i) for i in range(n)]


def test_the_walk_runs_once_per_call_only_where_a_spec_is_strided(monkeypatch):
    dtensor_foreach.install()
    wrapper = prop._propagate_use_strided_shard_flag
    calls = []
    monkeypatch.setattr(wrapper, "original", lambda *a: calls.append(a))
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        params, grads = _lists(mesh, Shard(0))
        torch._foreach_add_(params, grads, alpha=0.5)
        assert calls == []  # FSDP's Shard(0): nothing to fix up, nothing walked
        assert all(p.placements == (Shard(0),) for p in params)
        assert params[1].to_local().tolist() == [[6.5] * 3] * 2  # 1 + 0.5 * 11
        strided, others = _lists(mesh, _StridedShard(0, split_factor=2), n=3)
        torch._foreach_mul_(strided, others)
        assert calls, "a strided placement runs torch's fix-up"


def test_install_is_idempotent():
    dtensor_foreach.install()
    first = prop._propagate_use_strided_shard_flag
    dtensor_foreach.install()
    assert prop._propagate_use_strided_shard_flag is first and hasattr(first, "original")
