"""A work dir holding another run's checkpoints in the other form (a directory of shards where this run
writes files, or the reverse) stops the run before its first iteration, with one line naming the cause."""

from __future__ import annotations

import pytest
import torch

from memfit.checkpoint import find_checkpoints, save_checkpoint
from memfit.errors import CheckpointError

HOOKS = dict(checkpoint=dict(type="CheckpointHook", interval=1), logger=dict(interval=100))


def _snapshot(work) -> dict[str, tuple[int, int]]:
    """Every checkpoint file (inside sharded directories too) and the pointer: size and mtime."""
    paths = [p for c in find_checkpoints(work) for p in ([c] if c.is_file() else c.rglob("*"))]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in [*paths, work / "last_checkpoint"]}


def _fsdp_epoch_1(kit, work) -> None:
    kit.make_runner(work, strategy="fsdp", train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=HOOKS).train()
    torch.distributed.destroy_process_group()
    assert (work / "epoch_1.pth").is_dir()


def test_single_file_run_over_sharded_checkpoints_stops_before_training(tmp_path, kit):
    work = tmp_path / "work"
    _fsdp_epoch_1(kit, work)
    before = _snapshot(work)
    recorder = kit.Recorder()
    with pytest.raises(CheckpointError) as exc:
        kit.make_runner(work, default_hooks=HOOKS, custom_hooks=[recorder]).train()
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{work / 'epoch_1.pth'} is a sharded checkpoint of another run, and this run writes "
                          "its checkpoints as single files under the same names: continue that run with resume=True")
    assert recorder.iters == []
    assert _snapshot(work) == before


def test_sharded_run_over_single_file_checkpoints_stops_before_training(tmp_path, kit):
    work = tmp_path / "work"
    kit.make_runner(work, train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=HOOKS).train()
    before = _snapshot(work)
    recorder = kit.Recorder()
    with pytest.raises(CheckpointError, match="is a single-file checkpoint of another run, and this run writes "
                                              "its checkpoints as directories of shards"):
        kit.make_runner(work, strategy="fsdp", default_hooks=HOOKS, custom_hooks=[recorder]).train()
    assert recorder.iters == []
    assert _snapshot(work) == before


def test_resuming_the_other_run_writes_only_new_names(tmp_path, kit):
    """resume=True continues the FSDP run on one device: it writes epoch_2.pth, no name of the other form."""
    work = tmp_path / "work"
    _fsdp_epoch_1(kit, work)
    recorder = kit.Recorder()
    kit.make_runner(work, default_hooks=HOOKS, resume=True, custom_hooks=[recorder]).train()
    assert recorder.iters[0][0] == 8 and (work / "epoch_2.pth").is_file()


def test_write_error_names_the_directory_in_the_way(tmp_path):
    (tmp_path / "epoch_1.pth").mkdir()
    with pytest.raises(CheckpointError) as exc:
        save_checkpoint({"meta": {}}, tmp_path / "epoch_1.pth")
    msg = str(exc.value)
    assert "a directory of that name is in the way, a checkpoint of another run" in msg
    assert "free disk space" not in msg
