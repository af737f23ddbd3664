"""Work-dir checkpoint files: the last_checkpoint pointer, ordering by position, max_keep pruning."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from memfit.checkpoint import (
    LATEST_FILE,
    checkpoint_position,
    find_checkpoints,
    read_latest,
    remove_old,
    resolve_checkpoint,
    save_checkpoint,
    write_latest,
)
from memfit.errors import CheckpointError


@pytest.fixture
def memfit_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(logging.getLogger("memfit"), "propagate", True)
    caplog.set_level(logging.INFO, logger="memfit")
    return caplog


def _touch(work_dir: Path, *names: str) -> None:
    for i, name in enumerate(names):
        save_checkpoint({"name": name}, work_dir / name)
        os.utime(work_dir / name, (1000 + i, 1000 + i))  # creation order, independent of clock resolution


def test_find_sorts_by_number_and_ignores_other_files(tmp_path: Path) -> None:
    _touch(tmp_path, "iter_10.pth", "iter_9.pth", "iter_100.pth", "best_accuracy_iter_9.pth", "notes.pth")
    (tmp_path / ".iter_200.pth.tmp-123").write_bytes(b"partial")
    (tmp_path / "iter_50").mkdir()  # a sharded checkpoint directory
    (tmp_path / "iter_60").write_text("a file without .pth is not a checkpoint")
    names = [p.name for p in find_checkpoints(tmp_path)]
    assert names == ["iter_9.pth", "iter_10.pth", "iter_50", "iter_100.pth"]
    assert checkpoint_position(tmp_path / "epoch_12.pth") == 12 and checkpoint_position("best.pth") is None
    assert find_checkpoints(tmp_path / "missing") == []


def test_read_latest_follows_pointer(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    _touch(tmp_path, "epoch_1.pth", "epoch_2.pth")
    write_latest(tmp_path, "epoch_1.pth")  # the pointer, not the newest file, decides
    assert read_latest(tmp_path) == tmp_path / "epoch_1.pth"


def test_pointer_outside_work_dir_is_absolute(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    _touch(tmp_path, "iter_5.pth")
    write_latest(tmp_path / "run", tmp_path / "iter_5.pth")
    assert (tmp_path / "run" / LATEST_FILE).read_text() == str((tmp_path / "iter_5.pth").resolve())
    assert read_latest(tmp_path / "run") == (tmp_path / "iter_5.pth").resolve()


def test_dangling_pointer_falls_back_to_newest_complete(tmp_path: Path, memfit_log) -> None:
    _touch(tmp_path, "iter_2.pth", "iter_4.pth")
    (tmp_path / ".iter_6.pth.tmp-99").write_bytes(b"partial")
    write_latest(tmp_path, "iter_6.pth")  # e.g. deleted by hand after the pointer was written
    assert read_latest(tmp_path) == tmp_path / "iter_4.pth"
    assert "names" in memfit_log.text and "iter_6.pth, which does not exist" in memfit_log.text
    assert "newest complete checkpoint" in memfit_log.text


def test_missing_pointer_with_checkpoints_uses_newest(tmp_path: Path, memfit_log) -> None:
    # A kill between renaming the first checkpoint and writing the pointer.
    _touch(tmp_path, "epoch_1.pth")
    assert read_latest(tmp_path) == tmp_path / "epoch_1.pth"
    assert "is missing or empty" in memfit_log.text


def test_dangling_pointer_and_no_checkpoints_is_none(tmp_path: Path, memfit_log) -> None:
    write_latest(tmp_path, "iter_3.pth")
    assert read_latest(tmp_path) is None
    assert "has no checkpoints" in memfit_log.text


def test_remove_old_keeps_newest_best_and_pointer(tmp_path: Path) -> None:
    names = [f"epoch_{i}.pth" for i in range(1, 7)]
    _touch(tmp_path, *names, "best_acc_epoch_2.pth")
    (tmp_path / "epoch_3").mkdir()  # sharded checkpoints are removed as directories
    (tmp_path / "epoch_3" / "__0_0.distcp").write_bytes(b"x")
    write_latest(tmp_path, "epoch_1.pth")
    removed = remove_old(tmp_path, keep=2, protect={tmp_path / "epoch_4.pth"})
    assert sorted(p.name for p in removed) == ["epoch_2.pth", "epoch_3", "epoch_3.pth"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "best_acc_epoch_2.pth",
        "epoch_1.pth",
        "epoch_4.pth",
        "epoch_5.pth",
        "epoch_6.pth",
        LATEST_FILE,
    ]


def test_remove_old_with_non_positive_keep_keeps_all(tmp_path: Path) -> None:
    _touch(tmp_path, "iter_1.pth", "iter_2.pth")
    assert remove_old(tmp_path, keep=-1) == [] and remove_old(tmp_path, keep=0) == []
    assert len(find_checkpoints(tmp_path)) == 2


def test_resolve_keeps_files_missing_paths_and_sharded_directories(tmp_path: Path) -> None:
    _touch(tmp_path, "epoch_1.pth")
    for name, marker in (("sharded", "memfit_state.pth"), ("dcp", ".metadata")):
        (tmp_path / name).mkdir()
        (tmp_path / name / marker).write_bytes(b"x")
        assert resolve_checkpoint(tmp_path / name) == tmp_path / name
    assert resolve_checkpoint(tmp_path / "epoch_1.pth") == tmp_path / "epoch_1.pth"
    assert resolve_checkpoint(str(tmp_path / "none.pth")) == tmp_path / "none.pth"  # the loader names it


def test_resolve_a_work_dir_gives_its_last_checkpoint_and_says_so(tmp_path: Path, memfit_log) -> None:
    _touch(tmp_path, "epoch_1.pth", "epoch_2.pth")
    write_latest(tmp_path, "epoch_1.pth")
    assert resolve_checkpoint(tmp_path) == tmp_path / "epoch_1.pth"  # the pointer decides
    assert f"{tmp_path} is a work dir: using its last checkpoint {tmp_path / 'epoch_1.pth'}" in memfit_log.messages
    (tmp_path / LATEST_FILE).unlink()
    lines: list[str] = []
    assert resolve_checkpoint(tmp_path, log=lines.append) == tmp_path / "epoch_2.pth"  # no pointer: the newest
    assert lines == [f"{tmp_path} is a work dir: using its last checkpoint {tmp_path / 'epoch_2.pth'}"]


@pytest.mark.parametrize("content", ["nothing", "a log folder", "a dangling pointer"])
def test_resolve_a_directory_without_a_checkpoint_says_what_was_expected(tmp_path: Path, content: str) -> None:
    if content == "a log folder":
        (tmp_path / "20250101_120000").mkdir()
    elif content == "a dangling pointer":
        write_latest(tmp_path, "iter_3.pth")
    with pytest.raises(CheckpointError) as exc:
        resolve_checkpoint(tmp_path)
    assert str(exc.value) == (f"{tmp_path}: a directory without a checkpoint: give a checkpoint file, a sharded "
                              "checkpoint directory (holding memfit_state.pth or .metadata) or a work dir holding "
                              "last_checkpoint or epoch_N.pth / iter_N.pth")
