"""env_cfg.cudnn_benchmark (memfit.speed.cudnn): set on CUDA, one warning line elsewhere (configs are shared)."""

from __future__ import annotations

import logging

import pytest
import torch

from memfit.speed import apply_cudnn_benchmark
from memfit.strategies import SingleDeviceStrategy


@pytest.fixture(autouse=True)
def _restore_benchmark():
    before = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = before


def test_cudnn_benchmark_on_a_cpu_warns_once_and_changes_nothing(caplog):
    caplog.set_level(logging.INFO, logger="memfit")
    torch.backends.cudnn.benchmark = False
    SingleDeviceStrategy().setup_env("none", {"cudnn_benchmark": True})
    assert torch.backends.cudnn.benchmark is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert {r.getMessage() for r in warnings} == {
        "env_cfg.cudnn_benchmark=True has no effect on cpu (cuDNN is CUDA's); ignored"}
    caplog.clear()
    SingleDeviceStrategy().setup_env("none", {"cudnn_benchmark": False})
    assert not caplog.records


def test_cudnn_benchmark_is_set_on_cuda():
    torch.backends.cudnn.benchmark = False
    apply_cudnn_benchmark(True, torch.device("cuda", 0))  # only sets torch's flag: no GPU needed
    assert torch.backends.cudnn.benchmark is True
