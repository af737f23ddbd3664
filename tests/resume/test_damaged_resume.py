"""A damaged checkpoint never costs a run: resume=True skips it for the newest intact one with one warning
line, stops with one line when none is intact, and a checkpoint named explicitly is refused, not replaced."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from memfit.checkpoint import LATEST_FILE
from memfit.errors import CheckpointError

EVERY_2 = dict(checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False), logger=dict(interval=100))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, kit) -> tuple[Path, dict[str, torch.Tensor]]:
    """2 epochs of 8 iterations, iter_2.pth ... iter_16.pth; the final weights."""
    work = tmp_path_factory.mktemp("reference") / "work"
    runner = kit.make_runner(work, default_hooks=EVERY_2)
    runner.train()
    return work, {k: v.clone() for k, v in runner.model.state_dict().items()}


def _copy(uninterrupted, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(uninterrupted[0], work)
    return work


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _resume(kit, work: Path, resume=True):
    recorder = kit.Recorder()
    runner = kit.make_runner(work, default_hooks=EVERY_2, resume=resume, custom_hooks=[recorder])
    runner.train()
    return runner, recorder


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "memfit"]


def test_truncated_newest_falls_back_and_ends_as_uninterrupted(tmp_path, kit, uninterrupted, caplog):
    work = _copy(uninterrupted, tmp_path)
    _cut(work / "iter_16.pth", 0.5)
    runner, recorder = _resume(kit, work)
    [line] = [w for w in _warnings(caplog) if "iter_16.pth" in w]
    assert f"{work / 'iter_16.pth'} is damaged (truncated" in line
    assert line.endswith("resuming from iter_14.pth instead")
    assert [it for it, _, _ in recorder.iters] == [14, 15]
    for key, value in uninterrupted[1].items():
        assert torch.equal(runner.model.state_dict()[key], value), key


@pytest.mark.parametrize("fault", ["empty", "pointer_to_missing", "two_damaged"])
def test_other_faults_fall_back(tmp_path, kit, uninterrupted, caplog, fault):
    work = _copy(uninterrupted, tmp_path)
    if fault == "empty":
        (work / "iter_16.pth").write_bytes(b"")
        why, start = "iter_16.pth is damaged (empty: 0 bytes)", 14
    elif fault == "pointer_to_missing":
        (work / "iter_16.pth").unlink()
        why, start = f"{LATEST_FILE} names {work / 'iter_16.pth'}, which does not exist", 14
    else:
        _cut(work / "iter_16.pth", 0.9)
        (work / "iter_14.pth").write_bytes(b"")
        why, start = "iter_14.pth is damaged (empty: 0 bytes)", 12
    _, recorder = _resume(kit, work)
    [line] = [w for w in _warnings(caplog) if "resuming from" in w or "damaged" in w]
    assert why in line and line.endswith(f"resuming from iter_{start}.pth instead"), line
    assert recorder.iters[0][0] == start and recorder.iters[-1][0] == 15


def test_none_intact_stops_with_one_line(tmp_path, kit, uninterrupted):
    work = _copy(uninterrupted, tmp_path)
    for path in work.glob("iter_*.pth"):
        _cut(path, 0.3)
    recorder = kit.Recorder()
    with pytest.raises(CheckpointError) as exc:
        kit.make_runner(work, default_hooks=EVERY_2, resume=True, custom_hooks=[recorder]).train()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{work}: no intact checkpoint to resume from")
    assert all(f"{work / f'iter_{n}.pth'} is damaged (truncated" in msg for n in range(2, 17, 2)), msg
    assert recorder.iters == []


def test_named_damaged_checkpoint_is_refused_without_fallback(tmp_path, kit, uninterrupted):
    work = _copy(uninterrupted, tmp_path)
    named = work / "iter_16.pth"
    _cut(named, 0.5)
    (work / "iter_2.pth").write_bytes(b"")
    recorder = kit.Recorder()
    with pytest.raises(CheckpointError) as exc:
        kit.make_runner(tmp_path / "other", resume=str(named), custom_hooks=[recorder]).train()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"cannot load checkpoint {named}: it is damaged (truncated")
    assert msg.endswith(f"intact checkpoints in {work}: iter_14.pth, iter_12.pth, iter_10.pth, iter_8.pth, "
                        "iter_6.pth, iter_4.pth")
    assert recorder.iters == []


def test_sharded_checkpoint_with_a_missing_shard_falls_back(tmp_path, kit, caplog):
    """FSDP in one process (a one-process gloo group): iter_8 loses its shard file, iter_4 resumes."""
    work = tmp_path / "work"
    hooks = dict(checkpoint=dict(type="CheckpointHook", interval=4, by_epoch=False), logger=dict(interval=100))
    kit.make_runner(work, strategy="fsdp", train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=hooks).train()
    torch.distributed.destroy_process_group()
    assert (work / "iter_8.pth").is_dir()
    (work / "iter_8.pth" / "__0_0.distcp").unlink()
    recorder = kit.Recorder()
    kit.make_runner(work, strategy="fsdp", train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=hooks,
                    resume=True, custom_hooks=[recorder]).train()
    [line] = [w for w in _warnings(caplog) if "damaged" in w]
    assert f"{work / 'iter_8.pth'} is damaged (shard __0_0.distcp is missing)" in line
    assert line.endswith("resuming from iter_4.pth instead")
    assert [it for it, _, _ in recorder.iters] == [4, 5, 6, 7]


def test_named_work_dir_falls_back(tmp_path, kit, uninterrupted, caplog):
    """resume=<a work dir> stands for its newest intact checkpoint, as resume=True does."""
    work = _copy(uninterrupted, tmp_path)
    (work / "iter_16.pth").write_bytes(b"")
    _, recorder = _resume(kit, tmp_path / "new", resume=str(work))
    [line] = [w for w in _warnings(caplog) if "damaged" in w]
    assert line.endswith("is damaged (empty: 0 bytes): resuming from iter_14.pth instead")
    assert recorder.iters[0][0] == 14
