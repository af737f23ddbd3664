"""MemoryTracker: the same peak and breakdown as torch's MemTracker, the same on fake tensors; FSDP2 and
DDP labelled (on a fake process group of N ranks in this process). fp32 master weights:
tests/measure/test_tracker_master_weights.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist
import torchvision
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from memfit.measure import CATEGORIES, MB, CachingAllocatorModel, MemoryTracker


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


def test_the_observer_sees_the_same_operators_on_fake_and_real_tensors() -> None:
    """A fake tensor's ``.device`` is an operator call (autograd asks it of every gradient); a real one's is
    not. The observer (the planner's operator and FLOP count) sees neither: the counts are the real step's."""

    def observed(fake: bool) -> list[str]:
        seen: list[str] = []
        torch.manual_seed(0)
        model = mlp()
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext() as mode:
            x = mode.from_tensor(torch.randn(8, 64)) if fake else torch.randn(8, 64)
            with MemoryTracker(model, observer=lambda func, *a: seen.append(str(func))):
                model(x).sum().backward()
        return seen

    real, fake = observed(False), observed(True)
    assert "aten.mm.default" in real and not any(name.startswith("prim.") for name in fake)
    assert sorted(fake) == sorted(real)


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


def test_the_allocator_is_told_each_allocations_stream() -> None:
    """On CPU, FSDP2's ``device_handle.stream(s)`` blocks select torch.cpu's stand-in streams: what is made inside
    one goes on a stream of its own in the simulated allocator, whose freed block the default stream cannot use."""
    allocator = CachingAllocatorModel()
    with MemoryTracker(allocator=allocator):
        with torch.cpu.stream(torch.cpu.Stream()):
            side = torch.empty(2**20)  # 4 MiB: a 20 MiB segment of stream 1
        del side
        main = torch.empty(2**20)  # on the default stream: another segment
        del main
    assert [(size // MB, stream) for _, size, stream in allocator.segments] == [(20, 1), (20, 0)]


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


# -- distributed: a fake process group of N ranks in this process --------------------------------------
BLOCKS = 4
PARAM_BYTES = (BLOCKS * 256 * 257 + 10 * 257) * 4  # 4 Linear(256, 256) and a Linear(256, 10) head, fp32
STEP_COUNTERS = (2 * BLOCKS + 2) * 4  # Adam's fp32 ``step`` scalar per parameter
MARKER = 4_000_000


@pytest.fixture
def fake_pg(request: pytest.FixtureRequest) -> Iterator[int]:
    """A fake process group of ``request.param`` ranks (4 by default), this process rank 0; destroyed
    afterwards even when the test fails."""
    world_size = getattr(request, "param", 4)
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield world_size
    finally:
        tdist.destroy_process_group()


def blocks() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(BLOCKS)], nn.Linear(256, 10))


def fsdp_blocks(world_size: int, fake: FakeTensorMode) -> nn.Sequential:
    """``blocks()`` as tensors of ``fake``, the mode the step then runs in (tensors of another fake mode
    would be copied), sharded with FSDP2: each block, then the root. The planner's recipe: build on
    meta, materialise in fake mode; the mesh is real."""
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = blocks()
    with fake:
        model.to_empty(device="cpu")
        for block in model[:BLOCKS]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def sharded_bytes(model: nn.Module) -> int:
    return sum(p.to_local().nbytes for p in model.parameters())


def marked_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """``step`` with ``MARKER`` bytes allocated after backward: the peak, after the last reduce-scatter."""
    nn.functional.cross_entropy(model(x), y).backward()
    torch.empty(MARKER // 4)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("fake_pg", [4, 8], indirect=True)
def test_fsdp2_peak_equals_torch_fsdp_mem_tracker(fake_pg: int) -> None:
    """Same peak as torch's FSDPMemTracker; gathered parameters and all-gather/reduce-scatter buffers are
    communication, the batch is the only input."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = fsdp_blocks(fake_pg, fake)
    with fake:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 256), torch.arange(32) % 10
        step(model, opt, x, y)  # FSDP's lazy init and Adam's state
        with MemoryTracker(model, opt) as ours:
            step(model, opt, x, y)
        theirs = FSDPMemTracker(model, opt)
        theirs.track_inputs((x, y))
        with theirs:
            step(model, opt, x, y)
    # Keyed by _FSDPRefType members, and "Total".
    snap = {getattr(ref, "name", ref): n for ref, n in theirs.get_tracker_snapshot("peak")[x.device].items()}
    got = ours.breakdown
    assert ours.peak_bytes == snap["Total"] == sum(got.values())
    assert got["parameters"] == snap["SHARDED_PARAM"] == sharded_bytes(model)
    assert sharded_bytes(model) == pytest.approx(PARAM_BYTES / fake_pg, rel=0.01)  # up to padding
    assert got["optimizer_state"] == snap["OPT"] == 2 * sharded_bytes(model) + STEP_COUNTERS
    assert got["communication"] == snap["UNSHARDED_PARAM"] + snap["ALL_GATHER"] + snap["REDUCE_SCATTER"] > 0
    assert got["inputs"] == snap["INP"] == x.nbytes + y.nbytes
    # The peak is in backward: FSDPMemTracker counts the unsharded gradients as temporaries, we as gradients.
    assert got["gradients"] > snap["SHARDED_GRAD"] + snap["UNSHARDED_GRAD"]
    theirs_grads_and_temps = sum(snap[k] for k in ("SHARDED_GRAD", "UNSHARDED_GRAD", "ACT", "TEMP"))
    assert got["gradients"] + got["activations"] == theirs_grads_and_temps


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-hooks"])
@pytest.mark.parametrize("fake_pg", [4, 8], indirect=True)
def test_fsdp2_sharded_gradients_at_a_peak_after_reduce_scatter(fake_pg: int, hooks: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 assigns each sharded gradient (a view of the reduce-scatter output) to ``param.grad``. torch
    2.14 then calls the post-accumulate-grad hooks; without them (``no-hooks``, as an FSDP2 that does not
    call them) the walks after each reduce-scatter, at the optimizer step and at exit find the gradients,
    also for a peak before them."""
    if not hooks:
        monkeypatch.setattr(MemoryTracker, "_on_grad", lambda self, p: None)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = fsdp_blocks(fake_pg, fake)
    with fake:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 256), torch.arange(32) % 10
        breakdowns = []
        for _ in range(2):
            with MemoryTracker(model, opt) as t:
                marked_step(model, opt, x, y)
            breakdowns.append(t.breakdown)
    shard = sharded_bytes(model)
    common = dict.fromkeys(CATEGORIES, 0) | dict(parameters=shard, gradients=shard, activations=MARKER,
                                                 inputs=x.nbytes + y.nbytes)
    # The first step makes Adam's state after the peak; the second holds it from the start.
    assert breakdowns[0] == common
    assert breakdowns[1] == common | dict(optimizer_state=2 * shard + STEP_COUNTERS)


def test_fsdp2_gradients_accumulated_without_sync(fake_pg: int) -> None:
    """With gradient sync off FSDP2 keeps the unsharded gradients on its own records, no parameter's
    ``.grad``: they are gradients (the whole model's, unsharded), not activations."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = fsdp_blocks(fake_pg, fake)
    with fake:
        x, y = torch.randn(32, 256), torch.arange(32) % 10
        with MemoryTracker(model) as t:
            model.set_requires_gradient_sync(False)
            nn.functional.cross_entropy(model(x), y).backward()
            torch.empty(MARKER // 4)
    assert t.breakdown == dict.fromkeys(CATEGORIES, 0) | dict(parameters=sharded_bytes(model), gradients=PARAM_BYTES,
                                                              activations=MARKER, inputs=x.nbytes + y.nbytes)


def test_ddp_buckets_are_communication(fake_pg: int) -> None:
    """DDP's buckets (allocated in C++ when DDP is built, first seen by the step's all-reduce) are
    communication, not inputs. Real CPU tensors: DDP's reducer cannot run on fake ones."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(blocks(), init_sync=False)

    def all_reduce(state, bucket):  # unannotated: DDP rejects the string annotations of this module
        # The fake group's Work carries no result, which DDP's default hook returns: return the bucket.
        tdist.all_reduce(bucket.buffer())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, all_reduce)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256), torch.arange(32) % 10
    marked_step(model, opt, x, y)
    with MemoryTracker(model, opt) as t:
        marked_step(model, opt, x, y)
    assert t.breakdown == dict.fromkeys(CATEGORIES, 0) | dict(
        parameters=PARAM_BYTES, gradients=PARAM_BYTES, optimizer_state=2 * PARAM_BYTES + STEP_COUNTERS,
        communication=PARAM_BYTES, activations=MARKER, inputs=x.nbytes + y.nbytes)
