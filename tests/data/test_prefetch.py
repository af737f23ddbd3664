"""The input path: batches taken one step early and copied to the device on a side stream
(memfit.data.prefetch), non-blocking copies and pinned, worker-fed loaders by default on CUDA."""

from __future__ import annotations

import pytest
import torch

from memfit.data import build_dataloader
from memfit.data.loader import default_num_workers
from memfit.data.prefetch import prefetch
from memfit.model.base import BaseDataPreprocessor

CUDA = torch.cuda.is_available()


def _batches(n: int) -> list[dict]:
    return [{"inputs": torch.full((2, 3), float(i)), "meta": [torch.tensor(i), "name"]} for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_ahead_yields_every_batch_once_in_order(n):
    taken: list[int] = []

    def source():
        for b in _batches(n):
            taken.append(int(b["meta"][0]))
            yield b

    out = []
    for batch in prefetch(source(), torch.device("cpu"), ahead=True):
        # The next batch is already taken from the loader while this one is used (its step runs).
        assert len(taken) == min(len(out) + 2, n)
        out.append(batch)
    assert [int(b["meta"][0]) for b in out] == list(range(n))
    assert all(torch.equal(b["inputs"], e["inputs"]) and b["meta"][1] == "name" for b, e in zip(out, _batches(n)))


def test_cpu_passes_the_loader_through():
    it = iter(_batches(2))
    assert prefetch(it, torch.device("cpu")) is it


@pytest.mark.skipif(not CUDA, reason="the side-stream copy needs a CUDA device")
def test_cuda_batches_arrive_on_the_device_equal():
    device = torch.device("cuda")
    src = [{"inputs": torch.randn(64, 3, 32, 32).pin_memory()} for _ in range(4)]
    got = [b["inputs"] for b in prefetch(iter(src), device)]
    assert all(g.is_cuda for g in got)
    # Used on the compute stream right away (no explicit sync): the wait_stream makes the copy visible.
    doubled = [g * 2 for g in got]
    assert all(torch.equal(d.cpu(), b["inputs"] * 2) for d, b in zip(doubled, src))


def test_preprocessor_copies_non_blocking_only_to_cuda(monkeypatch):
    import memfit.model.base as base

    calls = []
    monkeypatch.setattr(base, "move_to", lambda data, device, non_blocking=False: calls.append(non_blocking) or data)
    pre = BaseDataPreprocessor()
    pre.cast_data(torch.zeros(1))
    pre.device = torch.device("cuda")
    pre.cast_data(torch.zeros(1))
    BaseDataPreprocessor(non_blocking=False).to("meta").cast_data(torch.zeros(1))  # meta: not CUDA
    off = BaseDataPreprocessor(non_blocking=False)
    off.device = torch.device("cuda")
    off.cast_data(torch.zeros(1))
    assert calls == [False, True, False, False]


def test_default_workers_fit_the_machine(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_num_workers("cpu") == 0 and default_num_workers(None) == 0
    assert default_num_workers("cuda") == 8  # 11 cores left for loading, at most 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_num_workers("cuda:1", world_size=8) == 2  # 12 cores / 4 local ranks, one for the trainer


def test_loader_pins_and_adds_workers_only_for_cuda(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = dict(batch_size=2, dataset=dict(type="ShapesDataset", num_samples=8, image_size=16))
    cpu = build_dataloader(cfg, seed=0, device="cpu")
    assert (cpu.pin_memory, cpu.num_workers) == (False, 0)
    cuda = build_dataloader(cfg, seed=0, device="cuda")
    assert (cuda.pin_memory, cuda.num_workers, cuda.persistent_workers) == (True, 3, True)
    given = build_dataloader({**cfg, "num_workers": 1, "pin_memory": False}, seed=0, device="cuda")
    assert (given.pin_memory, given.num_workers, given.persistent_workers) == (False, 1, False)
