"""A VISSL config (USE_STATEFUL_DISTRIBUTED_SAMPLER, CHECKPOINT_ITER_FREQUENCY, AUTO_RESUME) killed mid-epoch
resumes at the next unseen batch: no sample replayed or skipped, the same losses as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from memfit import cli
from memfit.hooks import Hook
from memfit.runner import Runner

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vissl" / "stateful_sampler.yaml"
SCRIPT = Path(__file__).parent / "scripts" / "vissl_run.py"
FROM_CFG = Runner.from_cfg.__func__  # unpatched


class Rows(Hook):
    """(iteration, loss hex, batch fingerprint) per iteration, as scripts/vissl_run.py writes them."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, str]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.rows.append((runner.iter, outputs["loss"].item().hex(), data_batch["img"].double().sum().item().hex()))


def _train(work_dir: Path, monkeypatch) -> list[tuple[int, str, str]]:
    """`memfit train CONFIG` in this process (AUTO_RESUME: resumes what work_dir holds)."""
    rows = Rows()

    def capture(cls, cfg):
        runner = FROM_CFG(cls, cfg)
        runner.register_hook(rows)
        return runner

    monkeypatch.setattr(Runner, "from_cfg", classmethod(capture))
    assert cli.main(["train", str(CONFIG), "--work-dir", str(work_dir)]) == 0
    return rows.rows


def test_mid_epoch_kill_resumes_at_the_next_unseen_batch(tmp_path, monkeypatch):
    reference = _train(tmp_path / "reference", monkeypatch)
    assert [r[0] for r in reference] == list(range(8))  # 64 samples / batch 16 = 4 per epoch, 2 epochs

    # Killed after iteration 2 of epoch 0, just after its checkpoint iter_2.pth (CHECKPOINT_ITER_FREQUENCY: 2).
    work, log = tmp_path / "work", tmp_path / "killed.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same device as the runs in this process
    proc = subprocess.run([sys.executable, str(SCRIPT), str(CONFIG), str(work), str(log), "2"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    killed = [(int(it), loss, batch) for it, loss, batch in (line.split() for line in log.read_text().splitlines())]
    assert killed == reference[:2]
    assert sorted(p.name for p in work.glob("*.pth")) == ["iter_2.pth"]

    resumed = _train(work, monkeypatch)  # AUTO_RESUME: true is VISSL's default
    assert resumed == reference[2:]  # batch 2 of epoch 0 first: nothing replayed, nothing skipped
