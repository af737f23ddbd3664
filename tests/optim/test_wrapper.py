"""OptimWrapper/AmpOptimWrapper: accumulation equals the large batch, last window, AMP, scaler."""

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.optim import AmpOptimWrapper, OptimWrapper
from memfit.strategies import SingleDeviceStrategy


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x)


def _train(wrapper_cls, batches, k, max_counts, **kw):
    model = Linear()
    w = wrapper_cls(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=k, **kw)
    w.initialize_count_status(model, 0, max_counts)
    for x, y in batches:
        with w.optim_context(model):
            loss = nn.functional.mse_loss(model(x), y)
        w.update_params(loss)
    return model


def test_accumulation_equals_large_batch():
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 3)
    micro = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 32, 4)]  # 8 micro-batches of 4
    large = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 32, 16)]  # 2 batches of 16
    acc = _train(OptimWrapper, micro, k=4, max_counts=8)
    ref = _train(OptimWrapper, large, k=1, max_counts=2)
    for a, b in zip(acc.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_last_incomplete_window_divides_by_real_count():
    torch.manual_seed(2)
    x, y = torch.randn(24, 8), torch.randn(24, 3)
    # 6 micro-batches, k=4: one full window of 4 and a tail of 2 (divided by 2, not 4).
    micro = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 24, 4)]
    ref_batches = [(x[:16], y[:16]), (x[16:], y[16:])]
    acc = _train(OptimWrapper, micro, k=4, max_counts=6)
    ref = _train(OptimWrapper, ref_batches, k=1, max_counts=2)
    for a, b in zip(acc.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_no_sync_on_non_final_micro_steps():
    calls = []

    class Recording(SingleDeviceStrategy):
        def no_sync(self, model, sync):
            calls.append(sync)
            return super().no_sync(model, sync)

    model = Linear()
    w = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
    w.strategy = Recording()
    w.initialize_count_status(model, 0, 7)
    for _ in range(7):
        with w.optim_context(model):
            loss = model(torch.randn(2, 8)).sum()
        w.update_params(loss)
    assert calls == [False, False, True, False, False, True, True]


def test_bn_warning_with_accumulation(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    w = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    with caplog.at_level("WARNING", logger="memfit"):
        w.initialize_count_status(model, 0, 10)
    assert "BatchNorm" in caplog.text


def test_bad_options_are_config_errors():
    p = [nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError, match="accumulative_counts"):
        OptimWrapper(torch.optim.SGD(p, lr=0.1), accumulative_counts=0)
    with pytest.raises(ConfigError, match="clip_grad"):
        OptimWrapper(torch.optim.SGD(p, lr=0.1), clip_grad=dict(max_nrom=1.0))


def test_bf16_amp_on_cpu_trains_and_has_no_scaler(monkeypatch):
    monkeypatch.setenv("MEMFIT_CPU_BF16", "1")  # a CPU with native bf16: the default dtype is bf16
    torch.manual_seed(0)
    model = Linear()
    w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    assert w.precision.dtype is torch.bfloat16 and w.scaler is None
    x, y = torch.randn(64, 8), torch.randn(64, 3)
    w.initialize_count_status(model, 0, 50)
    losses = []
    for _ in range(50):
        with w.optim_context(model):
            out = model(x)
            assert out.dtype is torch.bfloat16
            loss = nn.functional.mse_loss(out.float(), y)
        w.update_params(loss)
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_amp_default_stays_fp32_on_a_cpu_without_native_bf16(monkeypatch, caplog):
    monkeypatch.setenv("MEMFIT_CPU_BF16", "0")
    model = Linear()
    w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with w.optim_context(model):
        assert model(torch.randn(2, 8)).dtype is torch.float32
    assert w.precision.name == "fp32" and "has no native bf16" in caplog.text
    # An explicit dtype is honoured, with a warning that it is emulated.
    w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="bfloat16")
    with w.optim_context(model):
        assert model(torch.randn(2, 8)).dtype is torch.bfloat16
    assert "is emulated" in caplog.text


def test_fp16_scaler_counts_skipped_steps_and_round_trips():
    model = Linear()
    w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="float16", loss_scale="dynamic")
    assert w.scaler is not None
    before = [p.detach().clone() for p in model.parameters()]
    w.initialize_count_status(model, 0, 10)
    loss = model(torch.randn(2, 8)).sum() * float("inf")  # overflow: the step must be skipped
    w.update_params(loss)
    assert int(w.skipped_steps) == 1
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
    # MMEngine's state_dict carries the scaler; memfit's checkpoint state also the skipped-step count.
    w2 = AmpOptimWrapper(torch.optim.SGD(Linear().parameters(), lr=0.1), dtype="float16")
    w2.load_state_dict(w.state_dict())
    assert w2.scaler.get_scale() == w.scaler.get_scale() == 32768.0
    w2.load_checkpoint_state(w.checkpoint_state())
    assert w2.scaler.get_scale() == w.scaler.get_scale() and int(w2.skipped_steps) == 1


def test_fixed_loss_scale_stays_fixed_and_still_skips_overflows():
    model = Linear()
    w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="float16", loss_scale=512.0)
    w.initialize_count_status(model, 0, 10)
    w.update_params(model(torch.randn(2, 8)).sum())
    assert w.scaler.get_scale() == 512.0 and int(w.skipped_steps) == 0
    w.update_params(model(torch.randn(2, 8)).sum() * float("inf"))
    assert w.scaler.get_scale() == 512.0 and int(w.skipped_steps) == 1


@pytest.mark.parametrize("wrapper", ["fp32", "fp16-scaled"])
def test_clip_grad_equals_torch_clip_grad_norm_and_logs_the_total_norm(wrapper):
    """Three SGD-momentum steps clipped at max_norm=1 against torch's clip_grad_norm_ and a plain optimizer step
    on an identical model: the same weights, and the logged norm is the true total norm before clipping (of
    the unscaled gradients under a loss scale of 512: unscaled first, then clipped)."""
    torch.manual_seed(3)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    model, ref = Linear(), Linear()
    if wrapper == "fp32":
        w = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), clip_grad=dict(max_norm=1.0))
        autocast = torch.autocast("cpu", enabled=False)
    else:
        w = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dtype="float16",
                            loss_scale=512.0, clip_grad=dict(max_norm=1.0))
        autocast = torch.autocast("cpu", dtype=torch.float16)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    w.initialize_count_status(model, 0, 3)
    for _ in range(3):
        with w.optim_context(model):
            loss = nn.functional.mse_loss(model(x).float(), y) * 100
        w.update_params(loss)
        with autocast:
            ref_loss = nn.functional.mse_loss(ref(x).float(), y) * 100
        ref_loss.backward()
        true_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.parameters()]))
        assert true_norm > 10  # every step is clipped (to a tenth or less)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        # fp32 rounding only: the norm summed in another order (torch's per-tensor norms, then their norm).
        torch.testing.assert_close(w.log_scalars()["grad_norm"], true_norm, rtol=1e-6, atol=0)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
