"""OptimWrapper behaves as MMEngine's: counting in backward(), should_update/should_sync, no_sync of a
plain DDP model, get_lr/get_momentum per param group with base_lr, state_dict in the optimizer's shape.

Expected values come from MMEngine 0.10's OptimWrapper (optimizer_wrapper.py): ``backward`` does
``_inner_count += 1``; ``should_update`` is ``_inner_count % k == 0 or _inner_count == _max_counts``;
``should_sync`` the same for ``_inner_count + 1``; ``scale_loss`` divides by k, or by
``max_counts % k`` inside the last window.
"""

import textwrap

import pytest
import torch
from torch import nn

from memfit.optim import AmpOptimWrapper, OptimWrapper
from memfit.optim.builder import build_optim_wrapper
from memfit.testing import launch, read_results


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _count_steps(optimizer):
    steps = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    return steps


def test_manual_accumulation_loop_steps_every_k_backwards():
    # MMEngine's documented custom train_step: backward(loss); if should_update(): step(); zero_grad().
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    steps = _count_steps(wrapper.optimizer)
    updates = []
    for _ in range(6):
        with wrapper.optim_context(model):
            loss = model(torch.randn(2, 4)).sum()
        wrapper.backward(loss)
        updates.append(wrapper.should_update())
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()
    assert wrapper.inner_count == 6
    assert updates == [False, True, False, True, False, True]
    assert len(steps) == 3


def test_should_sync_looks_ahead_and_update_params_counts_once():
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
    wrapper.initialize_count_status(model, 0, 7)
    steps = _count_steps(wrapper.optimizer)
    syncs, counts = [], []
    for _ in range(7):
        syncs.append(wrapper.should_sync())
        wrapper.update_params(model(torch.randn(2, 4)).sum())
        counts.append(wrapper.inner_count)
    assert syncs == [False, False, True, False, False, True, True]
    assert counts == [1, 2, 3, 4, 5, 6, 7]
    assert len(steps) == 3  # windows of 3, 3 and the last of 1 (max_counts=7)


def test_scale_loss_divides_by_window_or_remainder():
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=4)
    wrapper.initialize_count_status(model, 0, 10)  # windows of 4, 4 and a remainder of 2
    factors = []
    for _ in range(10):
        factors.append(float(1 / wrapper.scale_loss(torch.tensor(1.0))))
        wrapper.backward(model(torch.randn(1, 4)).sum())
    assert factors == [4] * 8 + [2] * 2


def _grouped_wrapper(**kw):
    model = _model()
    cfg = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9, weight_decay=1e-4),
               paramwise_cfg=dict(norm_decay_mult=0.0, bias_lr_mult=2.0), **kw)
    return model, build_optim_wrapper(model, cfg)


def test_get_lr_and_momentum_per_group_with_base_lr():
    model, wrapper = _grouped_wrapper()
    groups = wrapper.optimizer.param_groups
    assert len(groups) > 1
    lrs = wrapper.get_lr()
    assert lrs["base_lr"] == [0.1]
    # One entry per parameter, as MMEngine's per-parameter groups: bias_lr_mult=2 doubles the Linear
    # biases' lr, not the LayerNorm's (MMEngine's add_params skips norm biases).
    assert lrs["lr"] == [0.1, 0.2, 0.1, 0.1, 0.1, 0.2]
    assert wrapper.get_momentum() == {"momentum": [0.9] * 6}
    # The schedulers see the pseudo group last; a scheduler changing it changes base_lr only.
    assert len(wrapper.param_groups) == len(groups) + 1 and wrapper.param_groups[-1]["params"] == []
    wrapper.param_groups[-1]["lr"] = 0.05
    assert wrapper.get_lr()["base_lr"] == [0.05]
    # One group: no base_lr (MMEngine's get_lr); Adam reports beta1 as momentum.
    single = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.99)))
    assert single.get_lr() == {"lr": [1e-3]} and single.get_momentum() == {"momentum": [0.8]}
    assert single.param_groups is single.optimizer.param_groups


def test_state_dict_is_the_optimizers_and_round_trips_with_a_plain_optimizer():
    model, wrapper = _grouped_wrapper()
    wrapper.update_params(model(torch.randn(2, 4)).sum())
    wrapper.param_groups[-1]["lr"] = 0.07
    state = wrapper.state_dict()
    assert set(state) == {"state", "param_groups", "base_param_settings"}
    assert state["base_param_settings"]["lr"] == 0.07
    assert "inner_count" not in state  # the accumulation position lives in the checkpoint, not here

    # Wrapper -> plain optimizer: the optimizer's own load_state_dict takes it once the extra is removed.
    plain = torch.optim.SGD([{"params": g["params"]} for g in wrapper.optimizer.param_groups], lr=1.0)
    plain.load_state_dict({k: v for k, v in state.items() if k != "base_param_settings"})
    assert [g["lr"] for g in plain.param_groups] == [g["lr"] for g in wrapper.optimizer.param_groups]
    for p in model.parameters():
        torch.testing.assert_close(plain.state[p]["momentum_buffer"], wrapper.optimizer.state[p]["momentum_buffer"])

    # Plain optimizer state -> wrapper, and the wrapper's own state back into a fresh wrapper.
    _, fresh = _grouped_wrapper()
    fresh.load_state_dict(plain.state_dict())
    assert fresh.get_lr()["lr"] == wrapper.get_lr()["lr"]
    _, again = _grouped_wrapper()
    again.load_state_dict(state)
    assert again.get_lr()["base_lr"] == [0.07]
    assert len(again.optimizer.state) == len(wrapper.optimizer.state)


def test_amp_state_dict_carries_loss_scaler():
    model = _model()
    wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="float16", loss_scale=256.0)
    state = wrapper.state_dict()
    assert set(state) == {"state", "param_groups", "loss_scaler"} and state["loss_scaler"]["scale"] == 256.0


DDP_SCRIPT = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from memfit.optim import OptimWrapper
    from memfit.testing import write_result

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 1, bias=False))
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0), accumulative_counts=2)
    grads = []
    for step in range(2):
        x = torch.full((1, 3), float(rank + 1))  # rank 0 sees 1s, rank 1 sees 2s
        with wrapper.optim_context(model):
            loss = model(x).sum()
        wrapper.backward(loss)
        grads.append(model.module.weight.grad[0, 0].item())
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()
    write_result(grads)
    dist.destroy_process_group()
''')


def test_optim_context_skips_sync_of_a_plain_ddp_model(tmp_path):
    script = tmp_path / "ddp_no_sync.py"
    script.write_text(DDP_SCRIPT)
    proc = launch(script, nproc=2, out_dir=tmp_path / "out", timeout=120)
    r0, r1 = read_results(tmp_path / "out", 2, proc)
    # backward() does not divide (update_params does). Micro-step 1 inside no_sync: each rank keeps its
    # own gradient (x). Micro-step 2 syncs: the all-reduce averages the accumulated sums
    # ((1 + 1) + (2 + 2)) / 2 = 3 on both ranks.
    assert r0[0] == pytest.approx(1.0) and r1[0] == pytest.approx(2.0)
    assert r0[1] == pytest.approx(3.0) and r1[1] == pytest.approx(3.0)
