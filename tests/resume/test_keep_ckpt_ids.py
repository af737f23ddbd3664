"""CheckpointHook ``max_keep_ckpts`` across a resume, as MMEngine's CheckpointHook: the kept checkpoints'
numbers are the message hub's ``keep_ckpt_ids``, saved in each checkpoint and restored on resume, so
the resumed run deletes the oldest of the whole run's checkpoints and nothing it did not save."""

from __future__ import annotations

import pytest

from memfit.checkpoint import load_checkpoint
from memfit.hooks import checkpoint as checkpoint_module


def _names(work_dir) -> list[str]:
    return sorted((p.name for p in work_dir.iterdir() if p.name.startswith("iter_")), key=lambda n: int(n[5:-4]))


def _expected(last: int, keep: int) -> list[str]:
    # interval=1 by iteration: iter_{n}.pth after every iteration n; the `keep` newest remain.
    return [f"iter_{n}.pth" for n in range(last - keep + 1, last + 1)]


def _run(kit, work_dir, max_iters: int, keep: int = 2, resume: bool = False, hooks: list | None = None):
    hook = dict(type="CheckpointHook", interval=1, by_epoch=False, max_keep_ckpts=keep)
    return kit.make_runner(work_dir, train_cfg=dict(by_epoch=False, max_iters=max_iters), resume=resume,
                           default_hooks=dict(checkpoint=hook), custom_hooks=hooks or [])


def _stop_before(kit, n: int):
    class Stop(kit.Recorder):
        def before_train_iter(self, runner, batch_idx, data_batch=None):
            if runner.iter + 1 == n:
                raise RuntimeError(f"stopped before iteration {n}")

    return dict(type=Stop)


def test_resumed_run_keeps_the_two_newest_of_the_whole_run(tmp_path, kit):
    with pytest.raises(RuntimeError, match="stopped before iteration 4"):
        _run(kit, tmp_path, 7, hooks=[_stop_before(kit, 4)]).train()
    assert _names(tmp_path) == _expected(3, 2)
    # Recorded as MMEngine does, in the message hub saved with the checkpoint; iter_1 was deleted
    # only after iter_3 was complete, so iter_3 still lists it.
    assert load_checkpoint(tmp_path / "iter_3.pth")["message_hub"]["runtime_info"]["keep_ckpt_ids"] == [1, 2, 3]
    _run(kit, tmp_path, 7, resume=True).train()
    assert _names(tmp_path) == _expected(7, 2)
    assert load_checkpoint(tmp_path / "iter_7.pth")["message_hub"]["runtime_info"]["keep_ckpt_ids"] == [5, 6, 7]


def test_checkpoints_the_run_did_not_save_are_never_deleted(tmp_path, kit):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "iter_50.pth").write_bytes(b"another run's")  # numbered ahead: not one of keep_ckpt_ids
    with pytest.raises(RuntimeError, match="stopped"):
        _run(kit, tmp_path, 5, hooks=[_stop_before(kit, 3)]).train()
    _run(kit, tmp_path, 5, resume=True).train()
    assert _names(tmp_path) == [*_expected(5, 2), "iter_50.pth"]


def test_kill_between_the_write_and_the_deletion_is_cleaned_up_by_the_resume(tmp_path, kit, monkeypatch):
    real_remove = checkpoint_module._remove

    def killed_at_iter_2(path):
        if path.name == "iter_2.pth":  # deleted after iter_4 (keep 2 of [2, 3, 4]) is written
            raise KeyboardInterrupt
        real_remove(path)

    monkeypatch.setattr(checkpoint_module, "_remove", killed_at_iter_2)
    with pytest.raises(KeyboardInterrupt):
        _run(kit, tmp_path, 6).train()
    assert _names(tmp_path) == ["iter_2.pth", "iter_3.pth", "iter_4.pth"]
    monkeypatch.setattr(checkpoint_module, "_remove", real_remove)
    _run(kit, tmp_path, 6, resume=True).train()
    assert _names(tmp_path) == _expected(6, 2)


def test_resume_with_fewer_kept_deletes_the_surplus_before_training(tmp_path, kit):
    _run(kit, tmp_path, 4, keep=3).train()
    assert _names(tmp_path) == _expected(4, 3)
    seen = []

    class Look(kit.Recorder):
        def before_train_iter(self, runner, batch_idx, data_batch=None):
            seen.append(_names(tmp_path))

    _run(kit, tmp_path, 5, keep=1, resume=True, hooks=[dict(type=Look)]).train()
    # MMEngine's before_train trims keep_ckpt_ids to max_keep_ckpts, oldest first.
    assert seen == [["iter_4.pth"]]
    assert _names(tmp_path) == _expected(5, 1)
