"""MemoryTracker: the same peak and breakdown as torch's MemTracker, the same on fake tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torchvision
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from memfit.memory.measure import CATEGORIES, MB, MemoryTracker


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def convnet() -> nn.Module:
    return torchvision.models.resnet18(num_classes=10)


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 64) if kind == "mlp" else torch.randn(4, 3, 32, 32)
    return x, torch.arange(x.shape[0]) % 10


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# MemTracker's categories -> ours (it labels activations saved in backward as "Temp" and tensors
# passed to track_external as "Other": our "inputs").
TORCH_NAMES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
    "Other": "inputs",
}


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("optim", ["SGD", "AdamW"])
def test_equal_to_torch_memtracker(kind: str, optim: str) -> None:
    torch.manual_seed(0)
    model = mlp() if kind == "mlp" else convnet()
    extra = {"momentum": 0.9} if optim == "SGD" else {}
    opt = getattr(torch.optim, optim)(model.parameters(), lr=1e-3, **extra)
    x, y = batch(kind)
    step(model, opt, x, y)  # creates the optimizer state, as every step after the first has it

    with MemoryTracker(model, opt) as ours:
        step(model, opt, x, y)

    theirs = MemTracker()
    theirs.track_external(model, opt, x, y)
    with theirs:
        step(model, opt, x, y)
    snap = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]
    expected = dict.fromkeys(CATEGORIES, 0)
    for ref, nbytes in snap.items():
        if ref != "Total":
            expected[TORCH_NAMES[ref.value]] += nbytes

    assert ours.peak_bytes == snap["Total"]  # to the byte
    assert ours.breakdown == expected
    assert sum(ours.breakdown.values()) == ours.peak_bytes
    assert ours.breakdown["gradients"] > 0 and ours.breakdown["optimizer_state"] > 0


def _run(kind: str, fake: bool) -> list[tuple[int, dict[str, int]]]:
    torch.manual_seed(0)
    build = mlp if kind == "mlp" else convnet
    if fake:  # the planner's recipe: build on meta, materialise as fake tensors
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    out = []
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if fake:
            model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = batch(kind)
        for _ in range(2):  # the second step has the optimizer state at entry
            with MemoryTracker(model, opt) as t:
                step(model, opt, x, y)
            out.append((t.peak_bytes, t.breakdown))
    return out


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_fake_tensors_give_the_real_peak(kind: str) -> None:
    real, fake = _run(kind, fake=False), _run(kind, fake=True)
    assert [p for p, _ in fake] == [p for p, _ in real]
    assert fake[1][1] == real[1][1]
    assert real[1][0] > 0


def test_meta_tensors_are_measured() -> None:
    with torch.device("meta"):
        model = mlp()
        x = torch.randn(32, 64)
    with MemoryTracker(model) as t:
        model(x).sum().backward()
        torch.empty(1_000_000)  # the peak: after backward, every gradient exists
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert t.device.type == "meta"
    assert t.breakdown["parameters"] == param_bytes
    assert t.breakdown["gradients"] == param_bytes
    assert t.breakdown["activations"] == 4_000_000


def test_counts_views_once_and_frees() -> None:
    with MemoryTracker() as t:
        a = torch.ones(1000)  # 4000 B
        v = a.view(10, 100)
        s = a[::2]
        del v, s
        b = torch.ones(500)  # 2000 B: 6000 live
        del a
        c = torch.ones(1000)  # 4000 B: 6000 live again
        del b, c
    assert t.peak_bytes == 6000
    assert t.breakdown["activations"] == 6000


def test_inputs_alive_before_entry_count_from_the_start() -> None:
    """A tensor first used late in the step held memory all along: the earlier peak includes it."""
    big = torch.zeros(250_000)  # 1,000,000 B, made before the tracker
    with MemoryTracker() as t:
        y = torch.ones(1000)  # 4000 B while ``big`` is alive
        del y
        big.sum()
    assert t.peak_bytes == 1_004_000
    assert t.breakdown == dict.fromkeys(CATEGORIES, 0) | {"inputs": 1_000_000, "activations": 4000}


def test_gradients_made_in_backward_are_labelled() -> None:
    torch.manual_seed(0)
    model = mlp()
    x, y = batch("mlp")
    with MemoryTracker(model) as t:
        nn.functional.cross_entropy(model(x), y).backward()
        torch.empty(1_000_000)  # the peak: after backward, every gradient exists
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert t.breakdown["parameters"] == param_bytes
    assert t.breakdown["gradients"] == param_bytes
    assert t.breakdown["inputs"] == x.nbytes + y.nbytes
    assert t.breakdown["activations"] == 4_000_000


def test_report_is_a_table_in_mb() -> None:
    model = nn.Linear(1024, 1024)
    with MemoryTracker(model) as t:
        model(torch.randn(8, 1024)).sum().backward()
    text = t.report()
    assert f"{'peak':<17}{t.peak_bytes / MB:>10.1f}" in text
    assert f"{'parameters':<17}{t.breakdown['parameters'] / MB:>10.1f}" in text
    assert round(t.breakdown["parameters"] / MB, 1) == 4.0


def test_tracker_leaves_no_trace() -> None:
    """After exit no hooks remain and storage resizing is torch's own again."""
    resize = torch.UntypedStorage.resize_
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryTracker(model, opt):
        assert torch.UntypedStorage.resize_ is not resize
    assert torch.UntypedStorage.resize_ is resize
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    x, y = batch("mlp")
    step(model, opt, x, y)  # runs without the tracker's hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator path needs a CUDA device")
def test_cuda_peak_from_allocator() -> None:
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = (t.cuda() for t in batch("mlp"))
    step(model, opt, x, y)
    with MemoryTracker(model, opt) as t:
        step(model, opt, x, y)
    assert t.uses_allocator
    assert t.peak_bytes == torch.cuda.max_memory_allocated()
    assert t.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert sum(t.breakdown.values()) >= t.peak_bytes
