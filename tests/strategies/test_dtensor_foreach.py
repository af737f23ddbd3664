"""memfit/strategies/dtensor_foreach.py: DTensor's foreach sharding propagation without the per-element walk
of every argument spec, and the same result (fake process group of 4 ranks, CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

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
        # A strided placement runs torch's fix-up as unwrapped: for each element's strategy, with the call's schema.
        assert len(calls) == 3 and all(schema is calls[0][1] for _, schema in calls), calls
        assert len({id(strategy) for strategy, _ in calls}) == 3


class _Schema:
    """An op schema as the wrapper reads it: ``args_spec`` (counted: each read is a walk over the call's specs)."""

    def __init__(self, placements: list) -> None:
        self.specs = [SimpleNamespace(placements=(p,)) for p in placements]
        self.reads = 0

    @property
    def args_spec(self) -> list:
        self.reads += 1
        return self.specs


def test_the_wrapper_walks_a_calls_specs_once_not_once_per_element(monkeypatch):
    """DTensor calls the function once per element of a foreach call, each time with the call's schema: the
    wrapper walks the specs at the first element only (N walks of N specs was the quadratic step), and where
    one is strided hands every element to torch's original."""
    dtensor_foreach.install()
    wrapper = prop._propagate_use_strided_shard_flag
    calls = []
    monkeypatch.setattr(wrapper, "original", lambda strategy, schema: calls.append((strategy, schema)))
    n = 50
    plain = _Schema([Shard(0)] * 2 * n)
    for i in range(n):
        wrapper(f"element {i}", plain)
    assert plain.reads == 1 and calls == []
    strided = _Schema([Shard(0)] * (2 * n - 1) + [_StridedShard(0, split_factor=2)])
    for i in range(n):
        wrapper(f"element {i}", strided)
    assert strided.reads == 1 and calls == [(f"element {i}", strided) for i in range(n)]


def test_install_is_idempotent():
    dtensor_foreach.install()
    first = prop._propagate_use_strided_shard_flag
    dtensor_foreach.install()
    assert prop._propagate_use_strided_shard_flag is first and hasattr(first, "original")
