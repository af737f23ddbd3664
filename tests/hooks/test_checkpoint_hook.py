"""CheckpointHook with MMEngine's arguments (mmengine/hooks/checkpoint_hook.py): save_best lists and rules,
greater_keys/less_keys, filename_tmpl, save_begin, out_dir with resume, published_keys, storage options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memfit.checkpoint import LATEST_FILE, load_checkpoint
from memfit.errors import ConfigError
from memfit.hooks import CheckpointHook
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model, scripted_metric


def _runner(work_dir, checkpoint: dict, script: list[dict] | None = None, **kw) -> Runner:
    """8 samples, batch 4: 2 iterations per epoch; 2 epochs unless train_cfg says otherwise."""
    base = dict(model=regression_model(), work_dir=str(work_dir), randomness=dict(seed=0),
                train_dataloader=dict(batch_size=4, dataset=regression_data(8)),
                train_cfg=dict(by_epoch=True, max_epochs=2),
                optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                default_hooks=dict(logger=dict(interval=100, tensorboard=False),
                                   checkpoint=dict(type="CheckpointHook", **checkpoint)))
    if script is not None:
        base.update(val_dataloader=dict(batch_size=4, dataset=regression_data(4)), val_cfg=dict(),
                    val_evaluator=scripted_metric(script))
    base.update(kw)
    return Runner(**base)


def _files(folder) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir() if p.suffix == ".pth")


def _hook(runner) -> CheckpointHook:
    return next(h for h in runner.hooks if isinstance(h, CheckpointHook))


def test_save_best_list_with_a_rule_per_metric_keeps_one_best_each():
    # MMEngine's example: save_best=['FID', 'IS'], rule=['less', 'greater'].
    script = [dict(FID=3.0, IS=1.0), dict(FID=2.0, IS=0.5), dict(FID=4.0, IS=2.0)]
    runner = _runner("w", dict(interval=-1, save_last=False, save_best=["FID", "IS"], rule=["less", "greater"]),
                     script, train_cfg=dict(by_epoch=True, max_epochs=3))
    runner.train()
    assert _files("w") == ["best_FID_epoch_2.pth", "best_IS_epoch_3.pth"]
    info = runner.message_hub.runtime_info
    assert info["best_score_FID"] == 2.0 and info["best_score_IS"] == 2.0
    assert info["best_ckpt_FID"] == str(runner.work_dir / "best_FID_epoch_2.pth")
    assert info["best_ckpt_IS"] == str(runner.work_dir / "best_IS_epoch_3.pth")
    assert "best_score" not in info and "best_ckpt" not in info
    # Saved at the validation after epoch 2 (4 iterations): MMEngine's meta.
    assert load_checkpoint(Path("w") / "best_FID_epoch_2.pth")["meta"]["epoch"] == 2
    assert load_checkpoint(Path("w") / "best_FID_epoch_2.pth")["meta"]["iter"] == 4


def test_single_best_by_iteration_records_best_score_and_best_ckpt():
    script = [dict(acc=0.5, map=0.3), dict(acc=0.4, map=0.9), dict(acc=0.7, map=0.1)]
    runner = _runner("w", dict(interval=-1, by_epoch=False, save_last=False, save_best="auto"), script,
                     train_cfg=dict(by_epoch=False, max_iters=6, val_interval=2))
    runner.train()
    # 'auto': the first metric, 'acc', whose rule is 'greater' (it is a default greater key).
    assert _hook(runner).key_indicators == ["acc"] and _hook(runner).rules == ["greater"]
    assert _files("w") == ["best_acc_iter_6.pth"]
    assert runner.message_hub.get_info("best_score") == 0.7
    assert runner.message_hub.get_info("best_ckpt") == str(runner.work_dir / "best_acc_iter_6.pth")


def test_rules_decided_by_greater_and_less_keys():
    # MMEngine's defaults: 'acc' and 'mIoU' greater, anything holding 'loss' less, case-insensitive.
    assert CheckpointHook(save_best=["acc", "mIoU"]).rules == ["greater", "greater"]
    assert CheckpointHook(save_best=["val_loss", "MAP", "accuracy/top1"]).rules == ["less", "greater", "greater"]
    assert CheckpointHook(save_best=["acc", "loss"], rule="greater").rules == ["greater", "greater"]
    # An exact less key wins over a greater key it contains; a str is one key.
    hook = CheckpointHook(save_best=["acc_err", "score"], greater_keys=["acc", "score"], less_keys="acc_err")
    assert hook.rules == ["less", "greater"] and hook.less_keys == ["acc_err"]
    with pytest.raises(ConfigError, match=r"default_hooks\.checkpoint\.rule: cannot infer .*'score'.*rule='greater'"):
        CheckpointHook(save_best="score")


def test_less_keys_decide_the_best_of_a_run():
    script = [dict(err=3.0), dict(err=1.0), dict(err=2.0)]
    runner = _runner("w", dict(interval=-1, save_last=False, save_best="err", less_keys=["err"]), script,
                     train_cfg=dict(by_epoch=True, max_epochs=3))
    runner.train()
    assert _files("w") == ["best_err_epoch_2.pth"] and runner.message_hub.get_info("best_score") == 1.0


def test_filename_tmpl_names_periodic_and_best_checkpoints_and_max_keep_finds_them():
    script = [dict(acc=0.1), dict(acc=0.9), dict(acc=0.5)]
    runner = _runner("w", dict(interval=1, filename_tmpl="ckpt_{}.pth", max_keep_ckpts=1, save_best="acc"), script,
                     train_cfg=dict(by_epoch=True, max_epochs=3))
    runner.train()
    assert _files("w") == ["best_acc_ckpt_2.pth", "ckpt_3.pth"]
    assert (Path("w") / LATEST_FILE).read_text() == "ckpt_3.pth"


@pytest.mark.parametrize("save_begin, expected", [(0, ["iter_2.pth", "iter_4.pth", "iter_6.pth"]),
                                                  (1, ["iter_1.pth", "iter_3.pth", "iter_5.pth"]),
                                                  (3, ["iter_3.pth", "iter_5.pth"])])
def test_save_begin_counts_the_interval_from_it(save_begin, expected):
    # every_n_train_iters(runner, interval=2, start=save_begin), as MMEngine's after_train_iter.
    _runner("w", dict(interval=2, by_epoch=False, save_last=False, save_begin=save_begin),
            train_cfg=dict(by_epoch=False, max_iters=6)).train()
    assert sorted(_files("w"), key=lambda n: int(n[5:-4])) == expected


def test_out_dir_holds_the_checkpoints_and_resume_finds_the_latest(tmp_path):
    hook = dict(interval=1, out_dir="out", max_keep_ckpts=2, save_best="acc")
    runner = _runner("runs/exp", hook, [dict(acc=0.2), dict(acc=0.4), dict(acc=0.3)],
                     train_cfg=dict(by_epoch=True, max_epochs=3))
    runner.train()
    out = tmp_path / "out" / "exp"  # out_dir/<last folder of work_dir>
    assert _hook(runner).out_dir == out
    assert _files(out) == ["best_acc_epoch_2.pth", "epoch_2.pth", "epoch_3.pth"]
    assert _files("runs/exp") == []
    assert (Path("runs/exp") / LATEST_FILE).read_text() == str(out / "epoch_3.pth")
    assert runner.message_hub.get_info("best_ckpt") == str(out / "best_acc_epoch_2.pth")
    assert runner.message_hub.get_info("last_ckpt") == str(out / "epoch_3.pth")

    resumed = _runner("runs/exp", hook, [dict(acc=0.9)], resume=True, train_cfg=dict(by_epoch=True, max_epochs=4))
    resumed.train()
    assert resumed.iter == 8 and resumed.val_loop.evaluator.metrics[0].calls == 1  # epoch 4 only
    assert _files(out) == ["best_acc_epoch_4.pth", "epoch_3.pth", "epoch_4.pth"]
    # memfit's best checkpoint holds the whole state and, saved last, is the one to resume from.
    assert (Path("runs/exp") / LATEST_FILE).read_text() == str(out / "best_acc_epoch_4.pth")
    assert load_checkpoint(out / "best_acc_epoch_4.pth")["loop"]["epoch"] == 4


def test_published_keys_write_a_hashed_copy_with_those_keys_only():
    runner = _runner("w", dict(interval=1, published_keys=["meta", "state_dict"]))
    runner.train()
    [published] = [n for n in _files("w") if re.fullmatch(r"epoch_2-[0-9a-f]{8}\.pth", n)]
    assert set(load_checkpoint(Path("w") / published)) == {"meta", "state_dict"}
    assert sorted(_files("w")) == sorted(["epoch_1.pth", "epoch_2.pth", published])


def test_storage_options_local_warn_others_are_one_line_errors(caplog):
    CheckpointHook(backend_args=dict(backend="local"))
    CheckpointHook(file_client_args=dict(backend="disk"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("default_hooks.checkpoint.backend_args has no effect" in m and "local disk" in m for m in warned)
    assert any("default_hooks.checkpoint.file_client_args has no effect" in m for m in warned)
    for kwargs, match in [(dict(backend_args=dict(backend="petrel")), "backend='petrel' is not supported"),
                          (dict(out_dir="s3://bucket/ckpts"), "local disk only"),
                          (dict(file_client_args=dict(backend="disk"), backend_args=dict(backend="local")),
                           "cannot both be set")]:
        with pytest.raises(ConfigError, match=match) as err:
            CheckpointHook(**kwargs)
        assert str(err.value).startswith("default_hooks.checkpoint") and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(save_best=dict(acc="acc")), r"save_best=\{'acc': 'acc'\}: use a str or a list of str"),
    (dict(save_best=["auto", "acc"]), "'auto' .* cannot be combined"),
    (dict(save_best=["acc", "acc"]), "duplicate"),
    (dict(save_best=["acc"], rule=1), "rule=1: use 'greater' or 'less'"),
    (dict(save_best=["acc"], rule=["greater", "less"]), "one rule, or one per save_best metric"),
    (dict(greater_keys=[1]), "greater_keys=\\[1\\]"),
    (dict(published_keys=3), "published_keys=3"),
    (dict(save_begin=-1), "save_begin=-1: use an int >= 0"),
    (dict(filename_tmpl="ckpt.pth"), "filename_tmpl='ckpt.pth': use a str with one '{}'"),
    (dict(out_dir=3), "out_dir=3: must be a str or Path"),
])
def test_bad_arguments_are_one_line_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        _runner("w", kwargs)
    assert str(err.value).startswith("default_hooks.checkpoint.") and "\n" not in str(err.value)


def test_a_pointer_written_in_out_dir_moves_to_the_work_dir(tmp_path):
    # A background (async) save is finalised by the strategy, which points last_checkpoint from the
    # checkpoint's own folder; the hook moves that pointer to the work dir, where resume=True reads it.
    from types import SimpleNamespace

    from memfit.checkpoint import read_latest, write_latest

    work, out = tmp_path / "runs" / "exp", tmp_path / "out" / "exp"
    out.mkdir(parents=True)
    (out / "iter_4.pth").write_bytes(b"x")
    write_latest(out, "iter_4.pth")
    hook = CheckpointHook(out_dir=str(tmp_path / "out"))
    hook.out_dir = out  # as before_train sets it
    hook.after_run(SimpleNamespace(work_dir=work, train_loop=object()))
    assert not (out / LATEST_FILE).exists() and read_latest(work) == out / "iter_4.pth"
