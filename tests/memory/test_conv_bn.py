"""Efficient Conv-BN eval: exact losses and gradients, train-mode passthrough, fallbacks, memory.

Tolerance for the folded path: atol 1e-5, rtol 1e-4 (the fold reorders float32 arithmetic:
``conv(x, W*c)`` against ``conv(x, W)*c``). Train-mode BN runs the original ops and is bit-exact.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.memory.conv_bn import apply_efficient_conv_bn_eval

TOL = dict(atol=1e-5, rtol=1e-4)


def _randomise_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so the fold is really exercised."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, FrozenBatchNorm2d)) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


def _resnet18(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"norm_layer": FrozenBatchNorm2d} if frozen else {}
    return _randomise_bn(torchvision.models.resnet18(num_classes=10, **kwargs))


def _loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: nn.Module, b: nn.Module, x: torch.Tensor, **tol: float) -> None:
    loss_a, grads_a = _loss_and_grads(a, x)
    loss_b, grads_b = _loss_and_grads(b, x)
    torch.testing.assert_close(loss_b, loss_a, **tol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **tol, msg=name)


@pytest.mark.parametrize("frozen", [False, True], ids=["bn-eval", "frozen-bn"])
def test_resnet18_loss_and_grads_match(frozen: bool, caplog: pytest.LogCaptureFixture) -> None:
    plain = _resnet18(frozen).eval()
    fused = copy.deepcopy(plain)
    with caplog.at_level(logging.INFO, logger="memfit"):
        n = apply_efficient_conv_bn_eval(fused, [""])
    # stem + 2 per BasicBlock * 8 + 3 downsample convs
    assert n == 20
    assert "Enabling efficient_conv_bn_eval for 20 conv-bn pairs" in caplog.text
    assert list(fused.state_dict()) == list(plain.state_dict())
    _assert_same(plain, fused, torch.randn(2, 3, 64, 64), **TOL)
    # Every BN affine parameter still gets a gradient (the fold is inside autograd).
    if not frozen:
        assert fused.layer1[0].bn1.weight.grad is not None and fused.layer1[0].bn1.weight.grad.abs().sum() > 0


def test_train_mode_bn_is_plain_and_mode_switch_works() -> None:
    plain = _resnet18().train()
    fused = copy.deepcopy(plain)
    apply_efficient_conv_bn_eval(fused, ["layer1", "layer2"])
    x = torch.randn(4, 3, 32, 32)
    _assert_same(plain, fused, x, atol=0.0, rtol=0.0)  # same ops: bit-exact
    # Running statistics were updated identically by the train-mode BN.
    bn_fused, bn_plain = fused.layer1[0].bn1, plain.layer1[0].bn1
    torch.testing.assert_close(bn_fused.running_var, bn_plain.running_var, atol=0, rtol=0)
    plain.eval()
    fused.eval()
    _assert_same(plain, fused, x, **TOL)
    plain.train()
    fused.train()
    _assert_same(plain, fused, x, atol=0.0, rtol=0.0)


def test_bf16_autocast_runs_conv_in_bf16_with_fp32_fold() -> None:
    plain = _resnet18().eval()
    fused = copy.deepcopy(plain)
    apply_efficient_conv_bn_eval(fused, [""])
    x = torch.randn(2, 3, 32, 32)
    seen = []
    fused.conv1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_plain = plain(x)
        out_fused = fused(x)
    assert seen == [torch.bfloat16]
    # bf16 has 8 mantissa bits: both paths round differently, within bf16 resolution of the output.
    torch.testing.assert_close(out_fused.float(), out_plain.float(), atol=0.1, rtol=0.05)
    out_fused.float().square().mean().backward()
    assert fused.bn1.weight.grad is not None and fused.bn1.weight.grad.dtype == torch.float32


class _Block(nn.Module):
    """A block fx cannot trace (data-dependent branch): found through its conv1/bn1 names."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # untraceable
            x = torch.relu(self.bn1(self.conv1(x)))
        return x


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = _Block()
        # Conv output used twice: must not be folded (the BN is not its only user).
        self.conv_shared, self.bn_shared = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
        # BN without running statistics uses batch statistics in eval mode: not an affine map.
        self.conv_nostats, self.bn_nostats = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0 and bool(x.abs().sum() > 0):
            x = self.block(self.stem(x))
        y = self.conv_shared(x)
        x = self.bn_shared(y) + y
        return self.bn_nostats(self.conv_nostats(x))


def test_untraceable_modules_fall_back_to_module_order() -> None:
    torch.manual_seed(0)
    plain = _randomise_bn(_Untraceable()).eval()
    fused = copy.deepcopy(plain)
    # stem (Sequential, traced on its own) + block (conv1/bn1 by name). conv_shared/bn_shared sit in
    # the untraced root and are not named convN/bnN, so they are left alone, as is the stats-less BN.
    assert apply_efficient_conv_bn_eval(fused, [""]) == 2
    assert getattr(fused.block.conv1, "_memfit_conv_bn_eval", False)
    assert not getattr(fused.conv_shared, "_memfit_conv_bn_eval", False)
    _assert_same(plain, fused, torch.randn(2, 3, 16, 16), **TOL)


def test_fx_skips_conv_with_two_users() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn2(self.conv2(self.bn(y) + y))

    torch.manual_seed(0)
    plain = _randomise_bn(Net()).eval()
    fused = copy.deepcopy(plain)
    assert apply_efficient_conv_bn_eval(fused, [""]) == 1  # conv2/bn2 only
    assert getattr(fused.conv2, "_memfit_conv_bn_eval", False)
    assert not getattr(fused.conv, "_memfit_conv_bn_eval", False)
    _assert_same(plain, fused, torch.randn(2, 3, 8, 8), **TOL)


def test_detector_that_does_not_trace_as_a_whole() -> None:
    from torchvision.models.detection import fasterrcnn_resnet50_fpn

    model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3)
    # ResNet-50 with FrozenBatchNorm2d: stem + 3 per Bottleneck * 16 + 4 downsample convs.
    assert apply_efficient_conv_bn_eval(model, ["backbone.body"]) == 53
    assert apply_efficient_conv_bn_eval(model, [""]) == 0  # already enabled: not counted twice


def test_unknown_name_lists_near_matches() -> None:
    with pytest.raises(ConfigError, match=r"no module named 'layer5'.*did you mean.*'layer[1-4]'"):
        apply_efficient_conv_bn_eval(_resnet18(), ["layer5"])


def test_peak_memory_is_lower() -> None:
    x = torch.randn(8, 3, 128, 128)

    def peak(model: nn.Module) -> int:
        with MemoryTracker(model) as tracker:
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        return tracker.peak_bytes

    # BatchNorm2d in eval mode saves its input (the conv output) for the gamma gradient; torchvision's
    # FrozenBatchNorm2d multiplies by a constant and saves nothing that large, so it gains no memory.
    model = _resnet18().eval()
    conv_out = []
    hooks = [m.register_forward_hook(lambda m, i, o: conv_out.append(o.nbytes))
             for m in model.modules() if isinstance(m, nn.Conv2d)]
    plain_peak = peak(model)
    for h in hooks:
        h.remove()
    apply_efficient_conv_bn_eval(model, [""])
    fused_peak = peak(model)
    # Measured: 20.0 of the 24.8 MiB of conv outputs are saved (the rest: the recomputed folded
    # weight of the largest conv, live during its backward). Require at least half.
    assert plain_peak - fused_peak > 0.5 * sum(conv_out), (plain_peak, fused_peak, sum(conv_out))
