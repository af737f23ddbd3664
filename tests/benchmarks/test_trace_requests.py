"""benchmarks/trace_requests.py: a fake step's second step set beside an allocator trace's, request by request."""

from __future__ import annotations

MiB = 2**20


def test_a_missing_temporary_and_a_reordered_free_show(bench_script):
    tr = bench_script("trace_requests")
    case = {"steps": [{"trace_len": 1}, {"trace_len": 8}],
            "trace": [["alloc", 0, 9 * MiB, 0],  # the first step's
                      ["alloc", 1, 4 * MiB, 0], ["alloc", 2, 2 * MiB, 0], ["alloc", 3, 2 * MiB, 0],
                      ["free_completed", 3, 2 * MiB, 0], ["free_requested", 2, 2 * MiB, 0],
                      ["free_completed", 2, 2 * MiB, 0], ["free_completed", 1, 4 * MiB, 0]]}
    real = tr.trace_step(case)
    assert real == [("+", 4 * MiB), ("+", 2 * MiB), ("+", 2 * MiB), ("-", 2 * MiB), ("-", 2 * MiB), ("-", 4 * MiB)]
    # The fake step's replay: the kernel's 2 MiB temporary missing, the 4 MiB block freed first.
    trace = [("a", 4 * MiB), (("again", "a"), 4 * MiB), (("again", "b"), 2 * MiB), (("again", "a"), None),
             (("again", "b"), None)]
    fake = tr.replayed_step(trace)
    assert fake == [("+", 4 * MiB), ("+", 2 * MiB), ("-", 4 * MiB), ("-", 2 * MiB)]
    out = tr.compare(real, fake, over=MiB)
    assert out["more"] == {2 * MiB: -1}
    assert 0 < out["ratio"] < 1 and out["regions"]
    assert tr.compare(real, real)["ratio"] == 1.0 and tr.compare(real, real)["regions"] == []


def test_a_workspace_only_the_trace_has_is_put_after_the_fake_steps_operator(bench_script):
    """``--ops``: the replayed calls carry the operator that made the first step's call they repeat (the block the
    step kept, its optimizer state, is not allocated again), and a block the trace allocates and frees at once where
    the fake step has nothing is listed after the operator before it."""
    from memfit.measure import CachingAllocatorModel

    tr = bench_script("trace_requests")
    allocator = CachingAllocatorModel()
    allocator.run([("state", 3 * MiB, 0), ("x", 4 * MiB, 0), ("y", 2 * MiB, 0), ("x", None, 0), ("y", None, 0)])
    where = allocator.replayed(0)
    assert where == [1, 2, 3, 4]
    allocator.replay(0)
    trace = allocator.trace
    assert trace[5:] == [(("again", "x"), 4 * MiB), (("again", "y"), 2 * MiB), (("again", "x"), None),
                         (("again", "y"), None)]
    labels = {0: "adam", 1: "conv", 2: "relu", 3: "relu", 4: "sum"}
    fake = tr.replayed_step(trace, where, labels)
    assert fake == [("+", 4 * MiB, "conv"), ("+", 2 * MiB, "relu"), ("-", 4 * MiB, "relu"), ("-", 2 * MiB, "sum")]
    real = [("+", 4 * MiB), ("+", 8 * MiB), ("-", 8 * MiB), ("+", 2 * MiB), ("-", 4 * MiB), ("-", 2 * MiB)]
    assert tr.workspaces(real, fake) == {"conv": [8 * MiB]}
