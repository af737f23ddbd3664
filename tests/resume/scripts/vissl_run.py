"""One `memfit train` of a VISSL config for the resume test, in a subprocess so that it can be SIGKILLed.

    python vissl_run.py CONFIG WORK_DIR LOG KILL_AFTER

Appends ``iteration loss_hex batch_hex`` per iteration to LOG (``batch_hex``: the sum of the batch's
images, a fingerprint of which samples it holds) and SIGKILLs itself after iteration KILL_AFTER's
hooks, the CheckpointHook's save included.
"""

from __future__ import annotations

import os
import signal
import sys

from memfit import cli
from memfit.hooks import Hook
from memfit.runner import Runner

config, work_dir, log, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


class RecordThenKill(Hook):
    priority = "LOWEST"  # after the CheckpointHook

    def __init__(self) -> None:
        self.file = open(log, "a", buffering=1)  # line-buffered: what was written survives the kill

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        fingerprint = data_batch["img"].double().sum().item().hex()
        self.file.write(f"{runner.iter} {outputs['loss'].item().hex()} {fingerprint}\n")
        if runner.iter + 1 == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)


from_cfg = Runner.from_cfg.__func__


def with_hook(cls, cfg):
    runner = from_cfg(cls, cfg)
    runner.register_hook(RecordThenKill())
    return runner


Runner.from_cfg = classmethod(with_hook)
sys.exit(cli.main(["train", config, "--work-dir", work_dir]))
