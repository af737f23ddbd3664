"""RNG state capture/restore: identical draws after restore, and a weights_only round trip."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from memfit.errors import CheckpointError


def _draw() -> tuple:
    # gauss() caches its second value (gauss_next) and numpy's normal() caches one too, so
    # drawing an odd number of each exercises the cached parts of both states.
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [float(np.random.randn())],
        torch.rand(3).tolist() + torch.randn(1).tolist(),
    )


def test_restore_reproduces_draws_of_all_generators(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()  # leave the generators mid-stream with cached gaussians
    state = capture_rng_state()
    save_checkpoint({"rng": state}, tmp_path / "rng.pth")
    expected = _draw()
    assert _draw() != expected  # the generators moved on: equality below is not trivial

    restore_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"])
    assert _draw() == expected
    restore_rng_state(state)  # the in-memory state works the same
    assert _draw() == expected


def test_state_is_plain_data() -> None:
    state = capture_rng_state()
    assert set(state) >= {"python", "numpy", "torch"}
    assert ("cuda" in state) == torch.cuda.is_available()
    assert isinstance(state["python"]["state"], list) and len(state["python"]["state"]) == 625
    assert state["numpy"]["keys"].dtype == torch.int64 and state["numpy"]["keys"].shape == (624,)
    assert state["torch"].dtype == torch.uint8


def test_malformed_state_is_a_checkpoint_error() -> None:
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(CheckpointError, match="RNG state is malformed.*'numpy'"):
        restore_rng_state(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA generator state needs a CUDA device")
def test_restore_reproduces_cuda_draws(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(4)
    state = capture_rng_state()
    save_checkpoint({"rng": state}, tmp_path / "rng.pth")
    expected = torch.rand(5, device="cuda").tolist()
    restore_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"])
    assert torch.rand(5, device="cuda").tolist() == expected
