"""Resume and load_from refuse bad checkpoints with one-line errors naming the file; nothing executes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.errors import CheckpointError


class _Payload:
    """Pickles as a call of os.system: loading it with plain pickle would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _one_line(exc: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    return msg


@pytest.fixture
def trained(tmp_path, kit) -> Path:
    """A real checkpoint: 1 epoch of the default runner, saved as epoch_1.pth."""
    hook = dict(type="CheckpointHook", interval=1)
    kit.make_runner(tmp_path / "src", train_cfg=dict(by_epoch=True, max_epochs=1),
                    default_hooks=dict(checkpoint=hook)).train()
    return tmp_path / "src" / "epoch_1.pth"


@pytest.mark.parametrize("how", ["resume", "load_from"])
def test_pickle_payload_is_refused_and_not_executed(tmp_path, kit, how):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pth"
    torch.save({"meta": _Payload(marker), "state_dict": {}}, bad)
    runner = kit.make_runner(tmp_path / "w", **{how: str(bad)})
    with pytest.raises(CheckpointError) as exc:
        runner.train()
    msg = _one_line(exc, bad)
    assert "refuses to unpickle" in msg and "os.system" in msg
    assert not marker.exists()


def test_missing_truncated_and_corrupt_checkpoints(tmp_path, kit, trained):
    with pytest.raises(CheckpointError, match="no such checkpoint file") as exc:
        kit.make_runner(tmp_path / "w", resume=str(tmp_path / "nope.pth")).train()
    _one_line(exc, tmp_path / "nope.pth")

    data = trained.read_bytes()
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as exc:
        kit.make_runner(tmp_path / "w", resume=str(truncated)).train()
    _one_line(exc, truncated)

    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="not a torch checkpoint") as exc:
        kit.make_runner(tmp_path / "w", load_from=str(corrupt)).train()
    _one_line(exc, corrupt)


def test_incompatible_model_and_changed_config(tmp_path, kit, trained):
    with pytest.raises(CheckpointError, match="does not fit the model: size mismatch for fc.weight") as exc:
        kit.make_runner(tmp_path / "w", model=dict(type=kit.DropoutNet, width=16), resume=str(trained)).train()
    _one_line(exc, trained)

    adamw = dict(optimizer=dict(type="AdamW", lr=1e-3))
    with pytest.raises(CheckpointError, match="saved with optimizer SGD, the config builds AdamW") as exc:
        kit.make_runner(tmp_path / "w", optim_wrapper=adamw, resume=str(trained)).train()
    _one_line(exc, trained)

    sched = dict(type="StepLR", step_size=1, by_epoch=True)
    with pytest.raises(CheckpointError, match="holds 0 param schedulers, the config has 1") as exc:
        kit.make_runner(tmp_path / "w", param_scheduler=sched, resume=str(trained)).train()
    _one_line(exc, trained)

    weights_only = tmp_path / "weights.pth"
    torch.save(kit.DropoutNet().state_dict(), weights_only)
    with pytest.raises(CheckpointError, match="not a memfit training checkpoint") as exc:
        kit.make_runner(tmp_path / "w", resume=str(weights_only)).train()
    _one_line(exc, weights_only)


def test_cli_resume_error_is_one_line_on_stderr(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(textwrap.dedent("""
        model = dict(type='TimmClassifier', model_name='test_vit', num_classes=2, img_size=32)
        train_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=8, image_size=32,
                                                           num_classes=2))
        train_cfg = dict(by_epoch=True, max_epochs=1)
        optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01))
    """))
    bad = tmp_path / "broken.pth"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", str(cfg), "--work-dir", str(tmp_path / "w"),
                           "--resume", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("memfit: error: cannot load checkpoint") and str(bad) in lines[0]
