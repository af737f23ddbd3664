"""memfit.dist.exit_process: a process that joined a process group ends as the interpreter would (threads
joined, atexit handlers run, output flushed, its status kept) without the interpreter's finalization, during
which gloo's worker threads can abort it (SIGABRT after training finished)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.testing import free_port

SCRIPT = Path(__file__).parent / "scripts" / "exit_hazard.py"


def _rank0(mode: str, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    folder.mkdir()
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), mode, str(folder)], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=120)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(mode, ranks[0].returncode, out, err)


@pytest.mark.parametrize("mode", ["memfit", "interpreter"])
def test_exit_process_finishes_what_an_exit_must_but_not_finalization(tmp_path, mode):
    rank0 = _rank0(mode, tmp_path / mode)
    assert rank0.returncode == 3, rank0.stderr[-2000:]
    assert rank0.stdout == "unflushed"
    left = {p.name for p in (tmp_path / mode).iterdir()}
    # The interpreter's own exit is the control: it finalizes (where gloo's threads may abort it).
    assert left == ({"thread", "atexit"} if mode == "memfit" else {"thread", "atexit", "finalized"})


def test_exit_process_without_a_group_is_sys_exit():
    proc = subprocess.run([sys.executable, "-c", "import atexit; atexit.register(print, 'atexit ran'); "
                           "from memfit.dist import exit_process; exit_process(3)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == "atexit ran\n"
