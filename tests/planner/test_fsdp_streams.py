"""The planner's fake FSDP2 step tells the simulated CUDA allocator which stream each allocation is on, as the real
step's allocator trace shows it (tests/fixtures/allocator: ViT-S/16, batch 32, bf16 autocast, AdamW, FSDP2 at one
rank, recorded on an H100 with torch 2.11).

In that trace FSDP2 allocates one thing off the default stream: each reduce-scatter's output (13 a step, 12 blocks
and the root; the sharded gradients are views of it, kept until ``zero_grad``), on its reduce-scatter stream. At
one rank there is no all-gather; at N ranks its output goes on the copy-in stream, as torch's code says. The input
prefetcher's batch copies are on a stream of their own, in the trace and in the fake step."""

from __future__ import annotations

from collections import Counter
from functools import cache
from unittest import mock

import pytest
import torch

import memfit.planner.fake as fake
from memfit.measure import CachingAllocatorModel
from memfit.planner.fake import fake_process_group, measure_step
from memfit.planner.step_calls import INPUT_STREAM
from tests.measure.test_allocator_traces import _case

BATCH = {"img": torch.zeros(32, 3, 224, 224), "label": torch.zeros(32, dtype=torch.long)}


class _Recording(CachingAllocatorModel):
    """The simulated allocator, keeping ``(key, nbytes, stream)`` of each request it serves."""

    made: list[_Recording] = []

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple] = []
        _Recording.made.append(self)

    def malloc(self, key, nbytes, stream=0) -> None:
        if nbytes > 0 and self.address(key) is None:
            self.requests.append((key, nbytes, stream))
        super().malloc(key, nbytes, stream)


@cache
def _fake_step(name: str) -> tuple[_Recording, dict]:
    """The fixture case's config (its model, optimizer wrapper and strategy) as the planner's fake step runs it for
    a CUDA target: one step, then its requests replayed as the second step makes them."""
    case = _case(name)
    cfg = {k: case["runner_cfg"][k] for k in ("model", "optim_wrapper", "strategy") if k in case["runner_cfg"]}
    _Recording.made.clear()
    with mock.patch.object(fake, "CachingAllocatorModel", _Recording), fake_process_group(1):
        measure_step(cfg, full=True, batch=BATCH, steps=1, cuda=True)
    return _Recording.made[0], case


def _off_default(case: dict) -> tuple[int, list[list[int]]]:
    """The real trace's FSDP stream (not the default one, nor the prefetcher's, whose batch copies are its first
    allocations) and the sizes allocated on it in each iteration."""
    rows, ends = case["trace"], [s["trace_len"] for s in case["steps"]]
    prefetcher = next(r[3] for r in rows if r[0] == "alloc")
    stream = next(r[3] for r in rows if r[0] == "alloc" and r[3] not in (0, prefetcher))
    return stream, [[r[2] for r in rows[a:b] if r[0] == "alloc" and r[3] == stream] for a, b in zip([0, *ends], ends)]


def test_reduce_scatter_outputs_go_on_the_stream_the_real_trace_shows():
    allocator, case = _fake_step("vit_s16_fsdp")
    stream, real = _off_default(case)
    assert real[0] == real[1] == [7_097_856] * 12 + [3_028_384]  # ViT-S: a block's fp32 gradients, then the root's
    off = [(key, n) for key, n, s in allocator.requests if s not in (0, INPUT_STREAM)]
    first = [n for key, n in off if not (isinstance(key, tuple) and key[0] == "again")]
    assert first == real[0] and [n for _, n in off[len(first):]] == real[1]  # the step, and its replay
    assert {s for _, _, s in allocator.requests} == {0, 1, INPUT_STREAM}
    # Blocks freed on that stream serve only its requests: it reserves its own segments, six of 20 MiB as torch.
    fake_segments = Counter(size for _, size, s in allocator.segments if s == 1)
    assert fake_segments == Counter(r[2] for r in case["trace"] if r[0] == "segment_alloc" and r[3] == stream)
    # With one pool for every stream the default stream's requests take most of those segments' space back
    # (measured: 102 MiB less reserved; torch's trace replayed so: 122 MiB less).
    one_pool = CachingAllocatorModel()
    for key, n in allocator.trace:
        one_pool.free(key) if n is None else one_pool.malloc(key, n)
    assert allocator.peak_reserved - one_pool.peak_reserved >= 4 * 20 * 2**20


def test_fsdp_is_as_near_torchs_reserved_as_the_same_step_without_it():
    """Measured: FSDP 1754 MiB against torch's 1754, without FSDP 1654 against 1632 (+1.3%, a tie between equal
    free blocks; 1648 while an operator's outputs were allocated last first); with every request on one stream FSDP's
    was 1652 (-5.8%). Both within the 1.5% the planner's CUDA figures are held to (tests/planner/test_cuda_traces)."""
    gaps = {}
    for name in ("vit_s16_fsdp", "vit_s16"):
        allocator, case = _fake_step(name)
        gaps[name] = allocator.peak_reserved / case["peaks"]["max_memory_reserved"] - 1
    assert gaps["vit_s16_fsdp"] == pytest.approx(gaps["vit_s16"], abs=0.015), gaps


@pytest.mark.parametrize("name", ["vit_s16", "vit_s16_fsdp"])
def test_the_batches_are_on_the_copy_stream_as_in_the_trace(name):
    """The Runner's prefetcher copies each batch on a stream of its own, the next one while a step runs: two
    batches (images 18.4 MiB, labels 256 B) in two 20 MiB segments and one 2 MiB segment of that stream's."""
    allocator, case = _fake_step(name)
    rows = case["trace"]
    prefetcher = next(r[3] for r in rows if r[0] == "alloc")
    real = Counter(r[2] for r in rows if r[0] == "segment_alloc" and r[3] == prefetcher)
    assert Counter(size for _, size, s in allocator.segments if s == INPUT_STREAM) == real
    assert real == Counter({20 * 2**20: 2, 2 * 2**20: 1})
