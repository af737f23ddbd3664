"""A composed row's allocations run in its sharding's recorded step (memfit/planner/sharded_replay.py): the
sharding's own calls kept where they were, the model's replaced by the row's. Against real sharded steps:
tests/planner/test_sync_points.py (rows' reserved memory equal to their own fake steps')."""

from __future__ import annotations

from memfit.measure import CachingAllocatorModel
from memfit.planner.sharded_replay import ShardedRows, ShardedSteps
from memfit.planner.sync_points import ShardTrace

MiB = 2**20
GRAD = -1


def _trace(calls: list[tuple], points_after: tuple[int, ...], optimizer: list[tuple] = ()) -> ShardTrace:
    """``calls``: (key, nbytes or None, own) of one forward/backward after a prefix of one block; a sync point after
    the calls numbered in ``points_after``; then ``optimizer``'s (key, nbytes or None)."""
    trace = [("weights", 4 * MiB)]
    own = bytearray()
    points = []
    for i, (key, nbytes, mine) in enumerate(calls):
        trace.append((key, nbytes))
        own.append(mine)
        if i in points_after:
            points.append(len(trace))
    end = len(trace)
    trace += list(optimizer)
    return ShardTrace(trace, {}, 1, end, tuple(points), (0,) * len(points), bytes(own))


# A unit's all-gather (the sharding's), its activations and gradient (the model's), the reduce-scatter taking the
# gradient (the sharding frees it), then the optimizer's state.
CALLS = [("gathered", 8 * MiB, True), ("act", 12 * MiB, False), ("grad", 8 * MiB, False), ("act", None, False),
         ("rs", 2 * MiB, True), ("grad", None, True), ("gathered", None, True)]
OPTIMIZER = [("state", 3 * MiB), ("rs", None)]


def _own_step(st: ShardTrace) -> CachingAllocatorModel:
    allocator = CachingAllocatorModel.rerun(st.trace, st.streams)
    allocator.replay(st.first)
    return allocator


def test_the_reference_activations_give_back_the_sharding_step():
    st = _trace(CALLS, (0, 3), OPTIMIZER)
    row = [("a", 12 * MiB, 0), ("g", 8 * MiB, 0), ("g", GRAD, 0), (None, 0, 0), ("a", None, 0), (None, 1, 0)]
    out, own = ShardedSteps(st).run(row), _own_step(st)
    assert (out.peak_allocated, out.peak_reserved) == (own.peak_allocated, own.peak_reserved)


def test_the_rows_activations_replace_the_models_and_its_gradient_is_freed_by_the_reduce_scatter():
    st = _trace(CALLS, (0, 3), OPTIMIZER)
    # the row holds 30 MiB of activations beside the gathered 8 MiB and its gradient
    row = [("a", 30 * MiB, 0), ("g", 8 * MiB, 0), ("g", GRAD, 0), (None, 0, 0), ("a", None, 0), (None, 1, 0)]
    out = ShardedSteps(st).run(row)
    # the second step: the weights, the state the first step made, the gathered unit, the row's bytes
    assert out.peak_allocated == 4 * MiB + 3 * MiB + 8 * MiB + 30 * MiB + 8 * MiB
    # the gradient went at the reduce-scatter: the second step's state and buffers are all that is left
    assert out.allocated == 4 * MiB + 3 * MiB


def test_an_optimizer_on_the_host_allocates_nothing_on_the_device():
    st = _trace(CALLS, (0, 3), [("state", 64 * MiB), ("rs", None)])
    row = [("a", 12 * MiB, 0), ("g", 8 * MiB, 0), ("g", GRAD, 0), (None, 0, 0), ("a", None, 0), (None, 1, 0)]
    assert ShardedSteps(st).run(row).peak_allocated >= 64 * MiB
    assert ShardedSteps(st).run(row, optimizer=False).peak_allocated < 64 * MiB


def test_a_row_with_other_sync_points_is_not_run():
    st = _trace(CALLS, (0, 3), OPTIMIZER)
    assert ShardedSteps(st).run([("a", MiB, 0), (None, 0, 0)]) is None


def test_rows_of_one_sharding_and_activations_run_once():
    st = _trace(CALLS, (0, 3), OPTIMIZER)
    row = [("a", 12 * MiB, 0), ("g", 8 * MiB, 0), ("g", GRAD, 0), (None, 0, 0), ("a", None, 0), (None, 1, 0)]
    made = []
    rows = ShardedRows()
    first = rows(st, "acts", "fsdp", True, 1, lambda: made.append(1) or row)
    again = rows(st, "acts", "fsdp", True, 1, lambda: made.append(1) or row)
    own = _own_step(st)
    assert first == again == (own.peak_allocated, own.reserved_beside_strays(), own.peak_requested)
    assert made == [1]


def test_a_sharding_call_goes_after_the_frees_that_precede_the_rows_next_allocation():
    """The recorded stretch: two allocations, a free, the sharding's all-gather, one more allocation. A checkpointed
    row's stretch starts with its recomputation's frees: the all-gather goes after the same share of the row's
    allocations, then of its frees (here all five come before its third allocation), not at the same share of all
    its calls (where it came before most of the frees, and found no free block for itself)."""
    from memfit.planner.sharded_replay import _Shares

    row = [("a", 1, 0), ("b", 1, 0), *[(f"r{i}", None, 0) for i in range(5)], ("c", 1, 0), ("d", 1, 0)]
    # recorded: made 2 and freed 1 (of 3 made, 1 freed) when the all-gather came
    at = _Shares(row, (3, 1))
    assert at((2, 1)) == 7  # after the 2 of the row's 4 allocations, then its 5 frees: before "c"
    assert at((0, 0)) == 0 and at((3, 1)) == 9  # after all: the end
    # the reference's own calls: the recorded order back
    ref = [("a", 1, 0), ("b", 1, 0), ("r0", None, 0), ("c", 1, 0)]
    assert _Shares(ref, (3, 1))((2, 1)) == 3 and _Shares(ref, (3, 1))((2, 0)) == 2
