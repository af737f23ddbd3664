"""Shared fixtures: run every test in its own directory, with one CPU thread."""

import os
import shutil

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU driver is present. Triton reads this
# when it is imported and when it decorates a kernel, so it is set before anything imports torch or triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's on-disk cache does not tell kernels built under a forced ATEN_CPU_CAPABILITY (avx2, to time an AVX2
# laptop's path on an AVX-512 CPU) from the CPU's own: loaded into the other, they gave NaN losses or crashed the
# process (torch 2.14.1). Each forced capability gets a cache of its own; a real AVX2 machine needs none.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

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


# The slowest test files (about 14 s or more each under `make test` on a 2-core CPU, two workers sharing it: most of
# it launching processes), longest first. `make test` hands whole files to two workers in collection order (--dist
# loadfile --no-loadscope-reorder): the long files go first, so that the two workers end together instead of one
# running a long file alone at the end.
SLOW_FIRST = [
    "strategies_ds/test_deepspeed.py", "planner/test_recompute.py", "planner/test_accuracy.py", "resume/test_chaos.py",
    "strategies/test_launch.py", "strategies/test_sharded_resume.py", "strategies/test_seeds_distributed.py",
    "planner/test_runs.py", "resume/test_exact_resume.py", "checkpoint/test_checkpoint_directory.py",
    "core/test_cli.py", "strategies_ds/test_colossalai.py", "speed/test_strategies.py",
    "strategies_ds/test_deepspeed_detection.py", "model/test_dino.py", "strategies/test_ddp_fsdp.py",
    "strategies/test_detection_distributed.py", "core/test_runner.py", "core/test_architecture.py",
    "hooks/test_preemption.py", "speed/test_compile.py", "strategies/test_vissl_techniques.py",
    "checkpoint/test_checkpoint_io.py", "planner/test_sync_points.py", "planner/test_cli.py",
    "memory/test_checkpointing.py", "hooks/test_invalid_loss.py", "strategies/test_publish_sharded.py",
    "measure/test_tracker.py", "planner/test_sharding_sweep.py", "optim/test_wrapper_mmengine.py",
    "strategies/test_async_save.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    here = os.path.dirname(os.path.abspath(__file__))

    def key(item):
        return rank.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), len(rank))

    items.sort(key=key)  # stable: the other files keep their order, after the slow ones
