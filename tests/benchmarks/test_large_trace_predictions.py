"""The planner's fake step of a large model against its H100 allocator trace
(tests/fixtures/allocator/h100_torch2.11_large_models.json.gz): Swin-B under FSDP at one rank, batch 32, bf16
autocast, the config of `benchmarks/gpu_calibration.py`'s case.

Its simulated allocator reserved 3.8% under the trace while the fake step lacked CUDA's softmax-backward temporary
(one fp32 block of the attention's size in each block's backward) and allocated an operator's outputs last first;
now +0.3%."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest

import memfit.planner.fake as fake
from tests.measure.test_allocator_traces_large import _case
from tests.planner.test_fsdp_streams import _Recording

CASE = "swin-b bf16 fsdp (one rank)"


@pytest.fixture(scope="module")
def stepped(tmp_path_factory) -> _Recording:
    """The case's fake step for an H100 (one step, then its requests replayed as the second step makes them)."""
    from tests.benchmarks.conftest import load_script

    cal = load_script("gpu_calibration")
    _, spec, options, words = next(c for c in cal.CASES if c[0] == CASE)
    cfg = cal._config(spec, options, cal._data(str(tmp_path_factory.mktemp("data"))))
    plan, facts = cal._plan(cfg, words, cuda=True)
    _Recording.made.clear()
    with mock.patch.object(fake, "CachingAllocatorModel", _Recording), fake.fake_process_group(1):
        fake.measure_step(plan.apply(cfg, facts), full=True, steps=1, cuda=True)
    return _Recording.made[0]


def test_swin_b_under_fsdp_reserves_what_its_trace_does(stepped):
    last = _case(CASE)["steps"][-1]
    assert stepped.peak_reserved == pytest.approx(last["max_reserved"], rel=0.01)
    assert stepped.peak_allocated == pytest.approx(last["max_allocated"], rel=0.005)


def test_its_attention_sized_blocks_are_the_traces(stepped):
    """Each stage's fp32 attention (windows x heads x 49 x 49): as many blocks in the fake step's second step as in
    the trace's (stage 3: 107, of which 18 are the softmax backward's temporaries)."""
    case = _case(CASE)
    ends = [s["trace_len"] for s in case["steps"]]
    real = Counter(r[2] for r in case["trace"][ends[-2]:ends[-1]] if r[0] == "alloc")
    second = Counter(n for key, n, _ in stepped.requests if isinstance(key, tuple) and key[0] == "again")
    for windows, heads in ((32 * 64, 4), (32 * 16, 8), (32 * 4, 16), (32, 32)):
        size = windows * heads * 49 * 49 * 4
        assert second[size] == real[size] > 0, (windows, heads)
