"""CheckpointHook: intervals by epoch and iteration, save_last, save_best, max_keep_ckpts, temp files."""

from __future__ import annotations

import pytest
import torch

from memfit.checkpoint import LATEST_FILE, load_checkpoint
from memfit.errors import ConfigError


def _ckpts(work_dir) -> list[str]:
    return sorted(p.name for p in work_dir.iterdir() if p.suffix == ".pth")


def _latest(work_dir) -> str:
    return (work_dir / LATEST_FILE).read_text().strip()


def test_epoch_interval_and_save_last(tmp_path, kit):
    hook = dict(type="CheckpointHook", interval=2, by_epoch=True, save_last=True)
    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=True, max_epochs=5), default_hooks=dict(checkpoint=hook)).train()
    assert _ckpts(tmp_path) == ["epoch_2.pth", "epoch_4.pth", "epoch_5.pth"]
    assert _latest(tmp_path) == "epoch_5.pth"
    state = load_checkpoint(tmp_path / "epoch_2.pth")
    # Saved at the end of epoch 2 (8 iterations per epoch): continue at the start of the third.
    assert state["loop"] == {"epoch": 2, "iter": 16, "batch_in_epoch": 0}
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["consumed"] == 32


@pytest.mark.parametrize("save_last, expected", [(True, ["iter_4.pth", "iter_8.pth", "iter_10.pth"]),
                                                 (False, ["iter_4.pth", "iter_8.pth"])])
def test_iteration_interval_and_save_last(tmp_path, kit, save_last, expected):
    hook = dict(type="CheckpointHook", interval=4, by_epoch=False, save_last=save_last)
    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=False, max_iters=10),
                    default_hooks=dict(checkpoint=hook)).train()
    assert sorted(_ckpts(tmp_path), key=lambda n: int(n[5:-4])) == expected
    # iter_4 was written in the hooks of the 4th iteration: it holds 4 done iterations, not 3.
    assert load_checkpoint(tmp_path / "iter_4.pth")["loop"] == {"epoch": 0, "iter": 4, "batch_in_epoch": 4}


def test_iteration_checkpoints_in_an_epoch_based_run(tmp_path, kit):
    hook = dict(type="CheckpointHook", interval=3, by_epoch=False, save_last=False)
    kit.make_runner(tmp_path, default_hooks=dict(checkpoint=hook)).train()
    assert load_checkpoint(tmp_path / "iter_9.pth")["loop"] == {"epoch": 1, "iter": 9, "batch_in_epoch": 1}


def test_save_best_greater_keeps_one_best_and_max_keep_spares_it(tmp_path, kit):
    scores = [1.0, 5.0, 2.0, 3.0, 1.0, 0.0]
    hook = dict(type="CheckpointHook", interval=1, max_keep_ckpts=2, save_best="score", rule="greater")
    runner = kit.make_runner(tmp_path, val=True, train_cfg=dict(by_epoch=True, max_epochs=6, val_interval=1),
                             default_hooks=dict(checkpoint=hook), custom_hooks=[kit.ScriptedScore(scores)])
    runner.train()
    assert _ckpts(tmp_path) == ["best_score_epoch_2.pth", "epoch_5.pth", "epoch_6.pth"]
    assert _latest(tmp_path) == "epoch_6.pth"
    best = load_checkpoint(tmp_path / "best_score_epoch_2.pth")
    assert best["message_hub"]["runtime_info"]["best_score"] == 5.0
    assert best["loop"] == {"epoch": 2, "iter": 16, "batch_in_epoch": 0}


def test_save_best_less_by_iteration_replaces_the_previous_best(tmp_path, kit):
    hook = dict(type="CheckpointHook", interval=-1, by_epoch=False, save_last=False, save_best="val_loss")
    runner = kit.make_runner(tmp_path, val=True, train_cfg=dict(by_epoch=False, max_iters=12, val_interval=4),
                             default_hooks=dict(checkpoint=hook),
                             custom_hooks=[kit.ScriptedScore([3.0, 1.0, 2.0], key="val_loss")])
    runner.train()
    # 'loss' in the key: rule 'less' by default; the best of iteration 4 was deleted at iteration 8.
    assert _ckpts(tmp_path) == ["best_val_loss_iter_8.pth"]


def test_resumed_run_keeps_its_best_score(tmp_path, kit):
    hook = dict(type="CheckpointHook", interval=1, save_best="score", rule="greater")
    common = dict(val=True, default_hooks=dict(checkpoint=hook))
    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1),
                    custom_hooks=[kit.ScriptedScore([4.0, 9.0])], **common).train()
    # The resumed run scores 5 < 9 in epoch 3: no new best may replace the one from before the kill.
    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=True, max_epochs=3, val_interval=1), resume=True,
                    custom_hooks=[kit.ScriptedScore([5.0])], **common).train()
    assert [n for n in _ckpts(tmp_path) if n.startswith("best")] == ["best_score_epoch_2.pth"]


def test_max_keep_never_deletes_the_last_checkpoint_target(tmp_path, kit):
    # A checkpoint numbered ahead of this run (left by an earlier, longer run) ranks as the newest,
    # so with max_keep_ckpts=1 count alone would delete the checkpoint just written.
    ahead = tmp_path / "iter_100.pth"
    ahead.parent.mkdir(parents=True, exist_ok=True)
    ahead.write_bytes(b"x")
    hook = dict(type="CheckpointHook", interval=4, by_epoch=False, max_keep_ckpts=1, save_last=False)
    recorded = []

    class AfterSave(kit.Recorder):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if runner.iter + 1 == 4:
                recorded.append(_ckpts(tmp_path))

    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=False, max_iters=8), default_hooks=dict(checkpoint=hook),
                    custom_hooks=[dict(type=AfterSave, priority="LOWEST")]).train()
    assert recorded == [["iter_100.pth", "iter_4.pth"]]
    assert _ckpts(tmp_path) == ["iter_100.pth", "iter_8.pth"]
    assert _latest(tmp_path) == "iter_8.pth"


def test_partial_files_of_an_interrupted_save_are_removed(tmp_path, kit, capsys):
    tmp_path.mkdir(exist_ok=True)
    stale = tmp_path / ".iter_4.pth.tmp-12345"
    stale.write_bytes(b"half a checkpoint")
    keep = tmp_path / "notes.tmp"
    keep.write_text("not ours")
    kit.make_runner(tmp_path, default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1))).train()
    assert not stale.exists() and keep.exists()
    assert "removed .iter_4.pth.tmp-12345" in capsys.readouterr().out


def test_without_optimizer_state_resume_warns_and_starts_it_afresh(tmp_path, kit, capsys):
    hook = dict(type="CheckpointHook", interval=1, save_optimizer=False, save_param_scheduler=False)
    kit.make_runner(tmp_path, train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=dict(checkpoint=hook),
                    param_scheduler=dict(type="StepLR", step_size=1, by_epoch=True)).train()
    state = load_checkpoint(tmp_path / "epoch_1.pth")
    assert "optim_wrapper" not in state and "param_schedulers" not in state
    full = load_checkpoint(tmp_path / "epoch_1.pth")["state_dict"]
    runner = kit.make_runner(tmp_path, train_cfg=dict(by_epoch=True, max_epochs=1), resume=True,
                             default_hooks=dict(checkpoint=hook),
                             param_scheduler=dict(type="StepLR", step_size=1, by_epoch=True))
    runner.train()
    out = capsys.readouterr().out
    assert "holds no optimizer state" in out and "holds no scheduler state" in out
    for key, value in full.items():  # the weights were restored
        assert torch.equal(runner.model.state_dict()[key].cpu(), value)


def test_bad_hook_options_are_config_errors(kit, tmp_path):
    with pytest.raises(ConfigError, match="rule='bigger'"):
        kit.make_runner(tmp_path, default_hooks=dict(checkpoint=dict(type="CheckpointHook", rule="bigger")))
    # MMEngine infers 'greater'/'less' from greater_keys/less_keys; 'a' matches neither.
    with pytest.raises(ConfigError, match="cannot infer"):
        kit.make_runner(tmp_path, default_hooks=dict(checkpoint=dict(type="CheckpointHook", save_best=["a", "b"])))
