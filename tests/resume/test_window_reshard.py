"""A checkpoint saved inside an accumulation window, resumed at another world size: every new rank starts from
the mean of the saved ranks' partial gradients, so that after the window's all-reduce (a mean over ranks) the
step is the one the saved ranks would have taken. (``python tools/chaos.py --reshard`` runs it end to end:
2 ranks killed, resumed on one with the same global batch, equal within float32 rounding.)"""

from __future__ import annotations

import torch

from memfit.resume import _mean_grads


def test_the_window_continues_from_the_mean_of_the_saved_ranks():
    torch.manual_seed(0)
    saved = [{"w": torch.randn(3, 2), "b": torch.randn(2)} for _ in range(2)]  # each rank's sum of micro-steps
    rest = [torch.randn(3, 2) for _ in range(2)]  # the window's remaining micro-steps, per old rank
    uninterrupted = torch.stack([saved[r]["w"] + rest[r] for r in range(2)]).mean(0)  # the all-reduce
    # One new rank with both old ranks' samples: its remaining micro-steps give the mean of theirs.
    resumed = _mean_grads(saved)["w"] + torch.stack(rest).mean(0)
    torch.testing.assert_close(resumed, uninterrupted, rtol=1e-6, atol=1e-6)
    assert sorted(_mean_grads(saved)) == ["b", "w"]
    assert _mean_grads([{"w": torch.ones(2, dtype=torch.bfloat16)}])["w"].dtype == torch.bfloat16
