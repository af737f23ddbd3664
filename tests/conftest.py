"""Shared fixtures: run every test in its own directory, with one CPU thread."""

import os
import shutil

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU driver is present. Triton reads this
# when it is imported and when it decorates a kernel, so it is set before anything imports torch or triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
# AmpOptimWrapper's default dtype on CPU depends on the CPU (bf16 only where it is native): pin it to
# fp32 so every machine runs the same tests at the same speed; precision tests set dtype explicitly.
os.environ.setdefault("MEMFIT_CPU_BF16", "0")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Seeds' snippets write to relative work dirs ('tmp_dir'): keep them inside tmp_path."""
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture(autouse=True)
def _capture_memfit_logs(caplog):
    """The 'memfit' logger does not propagate to the root logger: hand caplog its records directly."""
    import logging

    logger = logging.getLogger("memfit")
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """A strategy set up in-process joins a one-process group: do not let it leak into later tests."""
    yield
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
