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
