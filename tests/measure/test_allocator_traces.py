"""The simulated CUDA caching allocator (memfit.measure.caching_allocator) against the real one: traces of
three training steps of six memfit runs recorded on an H100 with torch 2.11.0+cu130, CUDA 13.0, default
allocator settings (tests/fixtures/allocator/README.md; the format: benchmarks/allocator_trace_format.py).

Each case is replayed over its initial segments: ``alloc`` -> ``malloc(addr, size, stream)``,
``free_completed`` -> ``free(addr)`` (a block freed under ``record_stream`` is only free once its events
completed; addresses key the blocks, a freed address is free again before torch reuses it). Two ways:

* with cudaMalloc's addresses (each ``segment_alloc`` row's address given to the model before the request
  that reserves it): the model must reserve the same segments at the same requests and put every block at
  torch's address; then peaks, per-step counters and the final segments are equal to the byte;
* with the model's own addresses (as the planner runs it): cudaMalloc's addresses do not rise (a quarter to
  two thirds of each case's segments lie below the one before), so where free blocks of equal size tie, the
  model may take another one (it does in every case, within its first 1,200 rows); the bounds below are
  what that costs on these traces.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import torch

from memfit.measure import CachingAllocatorModel

MiB = 2**20
FIXTURE = Path(__file__).parents[1] / "fixtures" / "allocator" / "h100_torch2.11_cuda13.json.gz"
CASES = ("vit_s16", "swin_t", "resnet50", "vit_s16_ac_blocks", "vit_s16_optimizer_offload", "vit_s16_fsdp")


@cache
def _fixture() -> dict:
    with gzip.open(FIXTURE, "rt") as f:
        return json.load(f)


def _case(name: str) -> dict:
    case = next((c for c in _fixture()["cases"] if c["name"] == name), None)
    if case is None:
        pytest.skip(f"{name}: not in the fixture")
    for key, why in (("error", "failed while recording"), ("skipped", "left out by the recording's time budget")):
        if case.get(key):
            pytest.skip(f"{name}: {why}: {case[key]}")
    if case.get("trace_truncated"):
        pytest.skip(f"{name}: torch's ring buffer filled, the trace lost its oldest rows")
    if not case["checks"]["reserved_ok"]:
        pytest.skip(f"{name}: the trace's segment rows do not add up to torch's reserved bytes (rows missing)")
    if {"segment_free", "oom"} & set(case["trace_actions"]):
        pytest.skip(f"{name}: segments released (empty_cache or an OOM retry), which the model does not do")
    return case


@dataclass
class Replay:
    """The model after the replay and what the trace itself says."""

    model: CachingAllocatorModel
    initial: int = 0  # the model's segments before the replay (the initial ones)
    real_peak_reserved: int = 0
    real_segments: Counter = field(default_factory=Counter)  # (size, stream) of each segment_alloc row
    misplaced: int = 0  # allocations the model put at another address than torch
    first_misplaced: str | None = None
    at_marks: list[tuple[int, int, int]] = field(default_factory=list)  # (allocated, reserved, peak allocated)

    def segments(self) -> Counter:
        """(size, stream) of each segment the model reserved during the replay."""
        return Counter((size, s) for _, size, s in self.model.segments[self.initial:])


def replay(initial: dict, rows: list[list], *, placed: bool, one_stream: bool = False,
           marks: tuple[int, ...] = ()) -> Replay:
    """Replay trace ``rows`` over the ``initial`` segments; ``placed``: new segments take the trace's addresses;
    ``one_stream``: every request on the default stream; ``marks``: row counts to read the counters at."""
    model = CachingAllocatorModel()
    for seg in initial["segments"]:
        blocks = [(addr if state != "inactive" else None, size) for addr, size, _, state in seg["blocks"]]
        model.add_segment(seg["total_size"], blocks, 0 if one_stream else seg["stream"], seg["address"])
    out = Replay(model, len(model.segments), initial["reserved"])
    reserved, todo = initial["reserved"], list(marks)
    for i, (action, addr, size, stream) in enumerate(rows):
        while todo and todo[0] == i:
            out.at_marks.append((model.allocated, model.reserved, model.peak_allocated))
            todo.pop(0)
        stream = 0 if one_stream else stream
        if action == "alloc":
            assert model.address(addr) is None, f"row {i}: {addr:#x} allocated again before its free"
            model.malloc(addr, size, stream)
            if placed and model.address(addr) != addr:
                out.misplaced += 1
                out.first_misplaced = out.first_misplaced or (
                    f"row {i}: {size} B on stream {stream} at {model.address(addr):#x}, torch {addr:#x}")
        elif action == "free_completed":
            model.free(addr)
        elif action == "segment_alloc":
            reserved += size
            out.real_peak_reserved = max(out.real_peak_reserved, reserved)
            out.real_segments[(size, stream)] += 1
            if placed:
                model.next_segment_at(addr)
        elif action == "segment_free":
            reserved -= size
    out.at_marks += [(model.allocated, model.reserved, model.peak_allocated)] * len(todo)
    return out


@pytest.mark.parametrize("name", CASES)
def test_with_cudas_addresses_every_block_lands_where_torch_put_it(name):
    """Exact: same segments at the same requests, every block at torch's address, every counter equal."""
    case = _case(name)
    marks = tuple(step["trace_len"] for step in case["steps"])
    r = replay(case["initial"], case["trace"], placed=True, marks=marks)
    m, peaks = r.model, case["peaks"]
    assert r.misplaced == 0, f"{r.misplaced} blocks misplaced, first at {r.first_misplaced}"
    assert r.segments() == r.real_segments
    assert m.peak_reserved == r.real_peak_reserved == peaks["max_memory_reserved"]
    assert m.peak_allocated == peaks["max_memory_allocated"]
    assert (m.allocated, m.reserved) == (peaks["memory_allocated"], peaks["memory_reserved"])
    for step, got in zip(case["steps"], r.at_marks):
        stats = step["stats"]
        assert got == (stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"],
                       stats["allocated_bytes.all.peak"]), f"after iteration {step['iter']}"
    torch_segments = [(s["address"], s["total_size"], s["stream"],
                       [(a, n, state != "inactive") for a, n, _, state in s["blocks"]])
                      for s in case["final_segments"]]
    assert sorted(m.segment_blocks()) == torch_segments


# With the model's own addresses (measured, see the module docstring): peak reserved equal in five cases,
# ViT-S +22 MiB (+1.35%: one 2 MiB and one 20 MiB segment more, after a tie went the other way); peak
# allocated within 0.04%. The bounds leave room for that, no more: a rule broken costs far more (one
# stream for all: FSDP's reserved 122 MiB, 7%, under).
RESERVED_BOUND = 0.015
ALLOCATED_BOUND = 0.001
EXTRA_SEGMENTS = 2


@pytest.mark.parametrize("name", CASES)
def test_with_its_own_addresses_the_model_stays_near_torch(name):
    case = _case(name)
    r = replay(case["initial"], case["trace"], placed=False)
    real_reserved, real_allocated = case["peaks"]["max_memory_reserved"], case["peaks"]["max_memory_allocated"]
    print(f"{name}: peak reserved {r.model.peak_reserved / MiB:.0f} MiB, torch {real_reserved / MiB:.0f}; "
          f"allocated {r.model.peak_allocated / MiB:.1f}, torch {real_allocated / MiB:.1f}")
    assert abs(r.model.peak_reserved - real_reserved) <= RESERVED_BOUND * real_reserved
    assert abs(r.model.peak_allocated - real_allocated) <= ALLOCATED_BOUND * real_allocated
    sim, real = r.segments(), r.real_segments
    assert sum(((sim - real) + (real - sim)).values()) <= EXTRA_SEGMENTS, (sim - real, real - sim)


def test_one_pool_for_every_stream_misses_what_fsdps_streams_reserve():
    """FSDP2 allocates each reduce-scatter's output on its reduce-scatter stream (at one rank it all-gathers
    nothing), the prefetcher its batch copies on another; blocks freed there are not reused by the default
    stream. With a pool per stream the model reserves what torch did (the test above); replayed as one stream it
    reuses them and reserves 122 MiB (7%) less than torch: six 20 MiB segments and one 2 MiB segment fewer. The
    planner's fake step puts the same requests on a stream of their own: tests/planner/test_fsdp_streams.py."""
    case = _case("vit_s16_fsdp")
    assert len({s for _, _, _, s in case["trace"]}) == 3
    merged = replay(case["initial"], case["trace"], placed=False, one_stream=True)
    assert case["peaks"]["max_memory_reserved"] - merged.model.peak_reserved == 122 * MiB
    fewer = merged.real_segments - merged.segments()  # one_stream: both keyed by (size, 0)
    assert fewer == Counter({(20 * MiB, 0): 6, (2 * MiB, 0): 1}) and not merged.segments() - merged.real_segments


def _record_random_program(seed: int) -> tuple[dict, list[list]]:
    """The allocator's trace (rows as the fixture's) of a random program of 600 allocations (512 B .. 48 MiB,
    log-uniform) and frees on the GPU, with the segments it started from (whatever earlier tests left)."""
    device = torch.cuda.current_device()

    def segments() -> list[dict]:
        out = []
        for s in torch.cuda.memory._snapshot()["segments"]:
            if s.get("device", device) != device:
                continue
            blocks = sorted(s["blocks"], key=lambda b: b["address"])
            out.append({"address": s["address"], "total_size": s["total_size"], "stream": s["stream"],
                        "blocks": [[b["address"], b["size"], None, b["state"]] for b in blocks]})
        return out

    torch.cuda.synchronize()
    initial = {"segments": segments(), "reserved": torch.cuda.memory_reserved()}
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=100_000)
    rng, live = random.Random(seed), {}
    try:
        for step in range(600):
            if live and rng.random() < 0.45:
                del live[rng.choice(list(live))]
            else:
                live[step] = torch.empty(int(2 ** rng.uniform(9, 25.6)), dtype=torch.uint8, device="cuda")
        entries = torch.cuda.memory._snapshot()["device_traces"][device]
    finally:
        live.clear()
        torch.cuda.memory._record_memory_history(enabled=None)
    return initial, [[e["action"], e.get("addr"), e.get("size"), e.get("stream", 0)] for e in entries]


def _native_default_allocator() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native")()
    return backend == "native" and "expandable_segments:true" not in conf.replace(" ", "").lower()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records the installed CUDA allocator")
@pytest.mark.parametrize("seed", [0, 1])
def test_follows_the_installed_cuda_allocator(seed):
    """The installed torch's allocator, whatever its version (the fixture is 2.11's): a random program recorded
    and replayed over the segments it started from, with cudaMalloc's addresses; every block must land where
    torch put it. Replaces a test that compared totals from an empty allocator with a model free to choose its
    own addresses (see test_caching_allocator.py's docstring)."""
    if not _native_default_allocator():
        pytest.skip("the model is of the native allocator without expandable segments")
    initial, rows = _record_random_program(seed)
    if any(row[0] in ("segment_free", "oom") for row in rows):
        pytest.skip("segments were released (an OOM retry), which the model does not do")
    r = replay(initial, rows, placed=True)
    assert r.misplaced == 0, f"torch {torch.__version__}: {r.misplaced} blocks misplaced, first at {r.first_misplaced}"
    assert r.segments() == r.real_segments and r.model.peak_reserved == r.real_peak_reserved
