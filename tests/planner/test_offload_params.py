"""FSDP's CPU offload (``offload:params``) keeps the sharded parameters, gradients and optimizer state on the host;
the unsharded gradients a step accumulates while gradient sync is off stay on the device, and its rows count them."""

from __future__ import annotations

import pytest
import torch

from memfit.planner.fake import build_meta_model, fake_process_group, measure_step
from tests.planner.test_fake_steps import Net
from tests.planner.test_two_steps import VIT, _composed_and_own, _config

ROWS = ("fp32 fsdp offload:params mb8x2", "fp32 fsdp mb8x2", "fp32 fsdp offload:params mb16x1",
        "fp32 ac:blocks fsdp offload:params mb8x2")


@pytest.fixture(scope="module")
def rows():
    cfg = _config(VIT, amp=False)
    grads = sum(p.numel() * 4 for p in build_meta_model(cfg["model"]).parameters() if p.requires_grad)
    return grads, _composed_and_own(cfg, list(ROWS), world_size=2)


def test_an_accumulating_row_holds_its_unsharded_gradients_on_the_device(rows):
    """Two micro-steps at 2 ranks: the first keeps the whole model's (unsharded) gradients, which the second adds
    to; only their shards go to the host. Were all gradients taken off, the row would be short of the model's
    gradients (the whole model's fp32 bytes per rank)."""
    grads, got = rows
    offloaded, own = got["fp32 fsdp offload:params mb8x2"]
    kept, kept_own = got["fp32 fsdp mb8x2"]
    for r in (offloaded, own):  # at the peak, a new gradient may also be beside the one it adds to
        assert grads <= r.breakdown["gradients"] <= grads * 1.05
        assert r.breakdown["parameters"] == r.breakdown["optimizer_state"] == 0
    kept_all = kept_own.breakdown["parameters"] + kept_own.breakdown["optimizer_state"]
    assert kept_own.allocated - own.allocated == pytest.approx(kept_all, rel=0.01)  # nothing else went to the host
    single, single_own = got["fp32 fsdp offload:params mb16x1"]
    assert single_own.breakdown["gradients"] < grads / 2  # no accumulation: the unsharded ones are freed as reduced
    assert own.allocated > single_own.allocated / 2 + grads / 2


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_tracker_tells_fsdps_sharded_gradients_from_its_unsharded_ones(accumulate):
    """At the optimizer step only the shards are left (a quarter of the gradients at 4 ranks, padded); in the
    forward/backward of a step that accumulates, the whole unsharded gradients are held beside few shards."""
    ow = dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3, foreach=True), accumulative_counts=accumulate)
    grads = sum(p.numel() * 4 for p in Net().parameters())
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    with fake_process_group(4):
        m = measure_step(dict(model=Net(), strategy=dict(type="FSDPStrategy"), optim_wrapper=ow), full=True,
                         batch=batch, steps=1, cuda=True)
        single = measure_step(dict(model=Net(), optim_wrapper=ow), full=True, batch=batch, steps=1, cuda=True)
    assert m.optimizer.sharded_grads == m.optimizer.breakdown["gradients"] == pytest.approx(grads / 4, rel=0.01)
    if accumulate > 1:
        fb = m.forward_backward  # at its peak, late in the last backward, the head's shard is made already
        assert fb.breakdown["gradients"] - fb.sharded_grads >= 0.95 * grads and fb.sharded_grads < 0.05 * grads
    assert single.optimizer.sharded_grads == single.forward_backward.sharded_grads == single.sharded_grads == 0
    assert single.optimizer.breakdown["gradients"] == grads


@pytest.mark.parametrize("words", [w for w in ROWS if "offload" in w])
def test_a_composed_offload_row_is_its_own_fake_step(rows, words):
    row, own = rows[1][words]
    assert row.source == "composed" and own.source == "measured"
    assert row.allocated == pytest.approx(own.allocated, rel=0.01), words
    assert row.reserved == pytest.approx(own.reserved, rel=0.03), words
