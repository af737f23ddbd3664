"""Activation checkpointing by splits (VISSL's NUM_ACTIVATION_CHECKPOINTING_SPLITS): torch's
checkpoint_sequential boundaries, N - 1 checkpointed regions, exact, saves memory, one-line errors."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import memfit.memory.checkpointing as ckpt
from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.memory.checkpointing import apply_activation_checkpointing


@pytest.fixture
def memfit_warnings() -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("memfit").addHandler(handler)
    yield records
    logging.getLogger("memfit").removeHandler(handler)


def block(dim: int, bn: bool = True) -> nn.Module:
    layers = [nn.Conv2d(dim, dim, 3, padding=1)] + ([nn.BatchNorm2d(dim)] if bn else []) + [nn.ReLU()]
    return nn.Sequential(*layers)


class Trunked(nn.Module):
    """VISSL's shape: a ``trunk`` (here an nn.Sequential of blocks) and a ``head``."""

    def __init__(self, depth: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, dim, 3, padding=1), *[block(dim) for _ in range(depth - 2)],
                                   nn.Dropout(0.2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dim, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # dropout draws the same mask in both models
    loss = nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % 10)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def hook_calls(children: nn.Module) -> list[int]:
    calls = [0] * len(children)
    for i, child in enumerate(children):
        child.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("length, splits", [(8, 1), (8, 2), (8, 3), (8, 8), (7, 3), (5, 4), (9, 2)])
def test_segments_are_checkpoint_sequentials(monkeypatch: pytest.MonkeyPatch, length: int, splits: int) -> None:
    """N - 1 checkpointed regions of len // N children; the last segment (with the remainder) runs plainly."""
    torch.manual_seed(0)
    ours = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(length)])
    theirs = copy.deepcopy(ours)
    ours_calls, theirs_calls = hook_calls(ours), hook_calls(theirs)
    regions = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda fn, *a, **kw: regions.append(1) or real(fn, *a, **kw))
    assert apply_activation_checkpointing(ours, dict(splits=splits)) == [""]
    x = torch.randn(3, 6, requires_grad=True)
    ours(x).sum().backward()
    checkpoint_sequential(theirs, splits, x, use_reentrant=False).sum().backward()
    assert len(regions) == splits - 1
    assert ours_calls == theirs_calls  # torch's boundaries, child by child
    recomputed = (splits - 1) * (length // splits)
    assert ours_calls == [2] * recomputed + [1] * (length - recomputed)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_exact_loss_gradients_and_batchnorm_statistics(splits: int) -> None:
    """Bit-identical loss and gradients, with train-mode BatchNorm and Dropout inside the segments; the
    BatchNorms' running statistics are updated once per step, not again by the recomputation."""
    torch.manual_seed(0)
    model, x = Trunked(), torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    assert apply_activation_checkpointing(model, dict(splits=splits, module="trunk")) == ["trunk"]
    for _ in range(2):
        (loss, grads), (ref_loss, ref_grads) = step(model, x), step(ref, x)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    state, ref_state = model.state_dict(), ref.state_dict()
    assert list(state) == list(ref_state)  # no wrapper modules, no renamed keys
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())  # running stats, num_batches_tracked


@pytest.mark.parametrize("spec", [["trunk.1", "trunk.2"], dict(types=["BatchNorm2d"], selective=True)])
def test_other_modes_no_longer_update_batchnorm_twice(spec: object) -> None:
    torch.manual_seed(0)
    model, x = Trunked(), torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    apply_activation_checkpointing(model, spec)
    step(model, x), step(ref, x)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_model_itself_when_module_is_omitted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), *[nn.Sequential(nn.Linear(12, 12), nn.GELU()) for _ in range(4)])
    ref = copy.deepcopy(model)
    assert apply_activation_checkpointing(model, dict(splits=2)) == [""]
    calls = hook_calls(model)
    x = torch.randn(2, 3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert calls == [2, 2, 1, 1, 1]  # 5 // 2 = 2 children per segment; the remainder joins the last
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_no_recomputation_without_gradients_and_after_deepcopy() -> None:
    torch.manual_seed(0)
    model, x = Trunked(), torch.randn(2, 3, 8, 8)
    apply_activation_checkpointing(model, dict(splits=3, module="trunk"))
    model.eval()
    with torch.no_grad():
        out = model(x)
    clone = copy.deepcopy(model)  # EMA: the copy's forward runs the copy's own children
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
        assert not torch.equal(clone(x), out)
    clone.train()
    calls = hook_calls(clone.trunk)
    clone(x).sum().backward()
    assert calls == [2, 2, 2, 2, 1, 1, 1, 1]
    assert all(p.grad is None for p in model.parameters())


def test_with_names_and_never_twice(memfit_warnings: list[logging.LogRecord]) -> None:
    torch.manual_seed(0)
    model, x = Trunked(), torch.randn(2, 3, 8, 8)
    ref = copy.deepcopy(model)
    done = apply_activation_checkpointing(model, dict(splits=2, module="trunk", names=["head", "trunk.6"]))
    assert done == ["head", "trunk"]
    assert "'trunk.6'" in memfit_warnings[-1].getMessage() and "is inside 'trunk'" in memfit_warnings[-1].getMessage()
    assert apply_activation_checkpointing(model, dict(splits=4, module="trunk")) == []  # already checkpointed
    calls = hook_calls(model.trunk)
    (loss, grads), (ref_loss, ref_grads) = step(model, x), step(ref, x)
    assert calls == [2, 2, 2, 2, 1, 1, 1, 1]
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_lowers_peak_memory() -> None:
    """Measured with memfit's tracker on 8 blocks (Linear 256 + GELU, batch 1024, fp32: 1 MiB a tensor).

    Plain keeps 2 tensors per block (23.0 MiB peak, 20.0 of activations); splits=N keeps N - 1 segment
    inputs, the plain last segment, and one recomputed segment at a time: 16.0 MiB at N=2, 14.0 at
    N=4, 16.0 at N=8 (the sqrt(depth) optimum of checkpoint_sequential)."""

    def peak(splits: int | None) -> tuple[int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
        if splits:
            apply_activation_checkpointing(model, dict(splits=splits))
        x = torch.randn(1024, 256)
        with MemoryTracker(model) as t:
            model(x).square().mean().backward()
        return t.peak_bytes, t.breakdown["activations"]

    mib = 2 ** 20
    (plain, plain_act), (two, two_act), (four, four_act), (eight, _) = peak(None), peak(2), peak(4), peak(8)
    assert four < two < plain and four_act < two_act < plain_act
    assert four < eight < plain
    assert plain - four >= 8 * mib, (plain / mib, two / mib, four / mib, eight / mib)


class Custom(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # not "children in order"
        return super().forward(x) + x


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(splits=2, module="head.2"), "'head.2' is a Linear, not an nn.Sequential"),
        (dict(splits=2), "the model is a Trunked, not an nn.Sequential running its children in order: splits "
                         "need one (set module='...' to one inside it)"),
        (dict(splits=9, module="trunk"), "splits=9: 'trunk' has only 8 children; use splits <= 8"),
        (dict(splits=0, module="trunk"), "splits must be a positive integer, got 0"),
        (dict(splits=True, module="trunk"), "splits must be a positive integer, got True"),
        (dict(splits=2, module="trunck"), "model has no module 'trunck': did you mean 'trunk'"),
        (dict(module="trunk"), "activation_checkpointing.module needs splits=N"),
        (dict(splits=2, module="trunk", selective=True), "splits and selective do not combine"),
        (dict(splits=2, modul="trunk"), "unknown key 'modul': did you mean 'module'"),
        (dict(splits=2, module="custom"), "'custom' is a Custom, not an nn.Sequential running its children"),
    ],
)
def test_bad_splits_are_one_line_config_errors(spec: dict, message: str) -> None:
    model = Trunked()
    model.custom = Custom(nn.Identity(), nn.Identity())
    with pytest.raises(ConfigError) as err:
        apply_activation_checkpointing(model, spec)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_splits_one_checkpoints_nothing_and_says_so(memfit_warnings: list[logging.LogRecord]) -> None:
    model = Trunked()
    assert apply_activation_checkpointing(model, dict(splits=1, module="trunk")) == ["trunk"]
    assert "splits=1 checkpoints nothing in 'trunk'" in memfit_warnings[-1].getMessage()


def test_through_the_connector_setup() -> None:
    """The runner's cfg switch (cfg=dict(activation_checkpointing=dict(splits=..., module=...)))."""
    from memfit.connector import setup
    from memfit.strategies import SingleDeviceStrategy

    torch.manual_seed(0)
    model = Trunked()
    model, _ = setup(model, SingleDeviceStrategy(), None, dict(activation_checkpointing=dict(splits=4, module="trunk")))
    assert isinstance(model.trunk.__dict__.get("forward"), ckpt.SplitCheckpointedForward)


def test_segments_starting_in_place_match_a_stock_torchvision_resnet():
    # torchvision's ReLU(inplace=True) as a segment's first child would overwrite the input the
    # checkpoint recomputes from; such a segment starts from a copy, so the result stays exact.
    import torchvision

    torch.manual_seed(0)
    r = torchvision.models.resnet18(num_classes=4)
    trunk = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4, r.avgpool,
                          nn.Flatten(), r.fc)
    ref = copy.deepcopy(trunk)
    x = torch.randn(2, 3, 32, 32)
    want = ref(x).sum()
    want.backward()
    apply_activation_checkpointing(trunk, dict(splits=8))  # one child per segment: 'relu' starts one
    got = trunk(x).sum()
    got.backward()
    assert torch.equal(got, want)
    for a, b in zip(trunk.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
