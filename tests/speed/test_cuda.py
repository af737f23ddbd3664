"""The speed levers on a CUDA GPU (skipped without one): inductor with Triton, regional and whole, with
checkpointing; channels_last through cuDNN; TF32 taking effect; fused AdamW under the fp16 GradScaler;
cudnn.benchmark; a Runner with all of them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)
# fp32 with TF32 off: kernels that fuse or reorder the same arithmetic (inductor's, cuDNN's NHWC ones).
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _full_fp32():
    """Full fp32 for the comparisons; the flags and cudnn.benchmark restored afterwards."""
    from memfit.speed import apply_tf32
    from memfit.speed.tf32 import tf32_flags

    flags, benchmark = tf32_flags(), torch.backends.cudnn.benchmark
    apply_tf32(False, CUDA)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    torch.backends.cudnn.benchmark = benchmark
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.relu(self.bn(self.conv(x)))
        return x + self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _model() -> nn.Module:
    from memfit.model import BaseModel

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stem = nn.Conv2d(3, 16, 3, padding=1)
            self.blocks = nn.Sequential(*[Block() for _ in range(3)])
            self.head = nn.Linear(16 * 8 * 8, 4)

        def forward(self, x, y=None, mode="tensor"):
            # A head over positions, not a global mean: a gradient that is uniform over H and W cancels in
            # BatchNorm's backward to a tiny true value, which NCHW and NHWC kernels round differently
            # (~3e-3 relative, measured on an H100): the comparison would test that cancellation.
            logits = self.head(self.blocks(self.stem(x))[:, :, ::4, ::4].flatten(1))
            return {"loss": nn.functional.cross_entropy(logits, y)} if mode == "loss" else logits

    return Net()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g).to(CUDA), torch.randint(0, 4, (8,), generator=g).to(CUDA)


def _step(model):
    model.zero_grad(set_to_none=True)
    x, y = _batch()
    x = model.data_preprocessor(x, True)
    loss = model(x, y, mode="loss")["loss"]
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], **TOL)
    for i in (1, 2):
        for name in want[i]:
            torch.testing.assert_close(got[i][name], want[i][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("spec, checkpointed", [(True, False), (True, True), (dict(regional=False), True)])
def test_inductor_on_cuda_is_exact(spec, checkpointed):
    from memfit.memory.checkpointing import apply_activation_checkpointing
    from memfit.speed import apply_compile, check_compiler, compile_options

    eager = _model().to(CUDA)
    compiled = copy.deepcopy(eager)
    if checkpointed:
        apply_activation_checkpointing(compiled, dict(types=["Block"]))
    options = compile_options(spec)
    check_compiler(options, CUDA)  # Triton is there
    apply_compile(compiled, options)
    for _ in range(2):  # the second step runs the cached graph (BatchNorm statistics updated once per step)
        _assert_same(_step(compiled), _step(eager))


def test_channels_last_on_cuda_is_exact():
    from memfit.speed import apply_channels_last

    plain = _model().to(CUDA)
    converted = copy.deepcopy(plain)
    apply_channels_last(converted)
    _assert_same(_step(converted), _step(plain))
    assert converted.stem.weight.grad.is_contiguous(memory_format=torch.channels_last)


def test_tf32_takes_effect_without_warnings():
    from memfit.speed import apply_tf32

    g = torch.Generator(device=CUDA).manual_seed(0)
    a, b = (torch.randn(1024, 1024, device=CUDA, generator=g) for _ in range(2))
    exact = (a.double() @ b.double()).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tf32(True, CUDA)
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        tf32_error = ((a @ b) - exact).abs().max().item()
        apply_tf32(False, CUDA)
        fp32_error = ((a @ b) - exact).abs().max().item()
    assert tf32_error > 10 * fp32_error  # a 10-bit mantissa against fp32's 23 bits


def test_fused_adamw_on_cuda_under_the_fp16_grad_scaler():
    from memfit.connector import setup
    from memfit.strategies import SingleDeviceStrategy

    def train(fused: bool):
        optim = dict(type="AmpOptimWrapper", dtype="float16",
                     optimizer=dict(type="AdamW", lr=1e-3, weight_decay=0.05, fused=fused))
        model, wrapper = setup(_model(), SingleDeviceStrategy(), optim)
        wrapper.initialize_count_status(model, 0, -1)
        for step in range(4):
            x, y = _batch()
            with wrapper.optim_context(model):
                loss = model(x, y, mode="loss")["loss"]
            wrapper.update_params(loss * float("inf") if step == 1 else loss)
        return model, wrapper

    (ref, ref_wrapper), (got, wrapper) = train(False), train(True)
    assert wrapper.optimizer.defaults["fused"] is True
    assert int(wrapper.skipped_steps) == int(ref_wrapper.skipped_steps) >= 1
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_runner_with_every_lever_trains(tmp_path):
    from memfit.runner import Runner
    from memfit.speed import compiled_modules

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 32, 32, generator=g), int(i % 4)) for i in range(16)]
    runner = Runner(model=_model(), work_dir=str(tmp_path), compile=True, randomness=dict(seed=0),
                    env_cfg=dict(cudnn_benchmark=True), cfg=dict(channels_last=True, tf32=True),
                    train_dataloader=dict(batch_size=8, dataset=data, num_workers=0),
                    train_cfg=dict(by_epoch=False, max_iters=4),
                    optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16",
                                       optimizer=dict(type="AdamW", lr=1e-3, fused=True)),
                    default_hooks=dict(checkpoint=None, logger=dict(interval=1)))
    runner.train()
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    assert compiled_modules(runner.model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert runner.model.stem.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())
