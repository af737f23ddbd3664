"""Rank script: a process that joined a gloo group ends through ``memfit.dist.exit_process`` (argv[1]
'memfit') or the interpreter's own exit ('interpreter'), with exit status 3.

Rank 0 leaves behind what an exit must finish: a non-daemon thread that writes ``thread`` in argv[2]'s
folder after 0.5 s, an atexit handler that writes ``atexit``, unflushed standard output, and an object of
``__main__`` that only the interpreter's finalization destroys (it writes ``finalized``): during that
finalization, gloo's worker threads abort the process when one needs the GIL (see exit_process).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as tdist

from memfit import dist

mode, folder = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("pytorch", timeout_s=60)
if tdist.get_rank() == 1:
    os._exit(0)


class FinalizedLate:
    """Destroyed as ``__main__`` is cleared, during the interpreter's finalization."""

    def __del__(self) -> None:
        (folder / "finalized").write_text("")


def _late_writer() -> None:
    time.sleep(0.5)
    (folder / "thread").write_text("")


group = tdist.group.WORLD  # held, as a model sharded over it holds it: destroy_process_group cannot free it
late = FinalizedLate()
threading.Thread(target=_late_writer).start()
atexit.register(lambda: (folder / "atexit").write_text(""))
sys.stdout.write("unflushed")
if mode == "memfit":
    dist.exit_process(3)
sys.exit(3)
