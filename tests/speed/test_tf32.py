"""TF32 (memfit.speed.tf32): refused on a CPU and below compute capability 8.0, in one line; on an Ampere GPU
(torch.cuda monkeypatched) True and False set both process-wide flags and absent leaves them."""

from __future__ import annotations

import pytest
import torch

from memfit.connector import setup
from memfit.errors import ConfigError
from memfit.speed import apply_tf32
from memfit.speed.tf32 import tf32_flags
from memfit.strategies import SingleDeviceStrategy

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _restore_flags():
    matmul, cudnn = tf32_flags()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_tf32_on_a_cpu_is_one_line():
    with pytest.raises(ConfigError, match=r"^tf32=True: TF32 is a CUDA GPU feature and this run is on cpu; "
                                          r"remove tf32$"):
        setup(torch.nn.Linear(2, 2), SingleDeviceStrategy(), None, dict(tf32=True))
    with pytest.raises(ConfigError, match=r"^tf32 must be True .* or False .*, got 'on'$"):
        apply_tf32("on", torch.device("cpu"))
    apply_tf32(False, torch.device("cpu"))  # full fp32 is what a CPU does anyway
    assert tf32_flags() == (False, False)


def test_tf32_sets_and_clears_both_flags_on_ampere(monkeypatch):
    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    apply_tf32(True, CUDA)
    assert tf32_flags() == (True, True)
    assert torch.get_float32_matmul_precision() == "high"  # still readable through torch's other API
    apply_tf32(False, CUDA)
    assert tf32_flags() == (False, False)
    torch.backends.cudnn.allow_tf32 = True
    apply_tf32(None, CUDA)  # absent: torch's settings stay as they are
    assert tf32_flags() == (False, True)


def test_tf32_below_ampere_is_one_line(monkeypatch):
    _gpu(monkeypatch, (7, 5), "Tesla T4")
    with pytest.raises(ConfigError, match=r"^tf32=True: Tesla T4 \(compute capability 7\.5\) has no TF32 \(it "
                                          r"needs 8\.0, Ampere, or newer\); remove tf32$"):
        apply_tf32(True, CUDA)
