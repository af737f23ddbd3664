"""benchmarks/allocator_trace_format.py: what a recorded allocator trace keeps of its entries' stack frames."""

from __future__ import annotations

MIB = 2**20


def test_large_allocations_keep_their_innermost_frames(bench_script):
    fmt = bench_script("allocator_trace_format")
    frames = [{"filename": f"/site-packages/timm/models/f{i}.py", "line": i, "name": f"fn{i}"} for i in range(9)]
    entries = [{"action": "alloc", "size": 2 * MIB, "frames": frames},
               {"action": "alloc", "size": MIB - 1, "frames": frames},  # small: not kept
               {"action": "free_completed", "size": 2 * MIB, "frames": frames},
               {"action": "alloc", "size": 3 * MIB, "frames": []},  # recorded without frames
               {"action": "alloc", "size": MIB, "frames": frames[:1]}]
    named = fmt.alloc_frames(entries)
    assert set(named) == {"0", "4"}
    assert named["0"].split(" < ") == [f"models/f{i}.py:{i}:fn{i}" for i in range(6)]  # innermost first, six
    assert named["4"] == "models/f0.py:0:fn0"
    rows, _, _ = fmt.compact_trace(entries)
    assert all(len(r) == len(fmt.TRACE_FIELDS) for r in rows)  # the rows themselves never keep frames
