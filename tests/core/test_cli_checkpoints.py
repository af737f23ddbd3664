"""The memfit command's checkpoint arguments (a file, a sharded directory or a work dir), MMDetection's
`eval CFG CKPT` and `--auto-scale-lr`, `--version`, the help texts, and a refused run's folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit._version import __version__
from memfit.cli import build_parser, main

CFG = """
model = dict(type='TimmClassifier', model_name='test_resnet', num_classes=2)
train_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=8, image_size=16, num_classes=2))
val_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=4, image_size=16, num_classes=2))
val_evaluator = dict(type='Accuracy')
val_cfg = dict()
train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=10)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
default_hooks = dict(logger=dict(interval=100, tensorboard=False))
randomness = dict(seed=0)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(config, work dir) of a 2-epoch run: epoch_1.pth, epoch_2.pth and last_checkpoint."""
    root = tmp_path_factory.mktemp("trained")
    cfg = root / "cfg.py"
    cfg.write_text(CFG)
    assert main(["train", str(cfg), "--work-dir", str(root / "wd")]) == 0
    return str(cfg), root / "wd"


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


def test_eval_takes_mmdetections_positional_checkpoint_and_a_work_dir(trained, capsys, caplog):
    cfg, wd = trained
    code, err, out = cli(capsys, "eval", cfg, str(wd), "--work-dir", "e")
    assert code == 0 and "accuracy/top1:" in out, err
    assert f"{wd} is a work dir: using its last checkpoint {wd / 'epoch_2.pth'}" in caplog.messages
    code, err, out = cli(capsys, "eval", cfg, "--checkpoint", str(wd / "epoch_1.pth"), "--work-dir", "e")
    assert code == 0 and "accuracy/top1:" in out, err
    same = str(wd / "epoch_1.pth")
    assert cli(capsys, "eval", cfg, same, "--checkpoint", same, "--work-dir", "e")[0] == 0
    code, err, _ = cli(capsys, "eval", cfg, str(wd / "epoch_1.pth"), "--checkpoint", str(wd), "--work-dir", "e")
    assert code == 2 and err == [f"memfit: error: eval: two checkpoints, {same!r} and --checkpoint {str(wd)!r}: "
                                 "give one"]
    code, err, _ = cli(capsys, "eval", cfg, "--work-dir", "e")
    assert code == 2 and len(err) == 1 and "eval: no checkpoint: memfit eval CFG CHECKPOINT" in err[0]


def test_export_of_a_work_dir_writes_its_last_checkpoint_with_a_checkpoints_mode(trained, capsys):
    _, wd = trained
    umask = os.umask(0o022)
    try:
        code, err, out = cli(capsys, "export", str(wd), "--out", "m.safetensors")
    finally:
        os.umask(umask)
    assert code == 0 and err == [f"{wd} is a work dir: using its last checkpoint {wd / 'epoch_2.pth'}"]
    state = torch.load(wd / "epoch_2.pth", weights_only=True)["state_dict"]
    weights = load_file("m.safetensors")
    assert set(weights) == set(state) and all(torch.equal(weights[k], state[k]) for k in state)
    assert stat.S_IMODE(os.stat("m.safetensors").st_mode) == stat.S_IMODE(os.stat(wd / "epoch_2.pth").st_mode) == 0o644


def test_resume_from_a_work_dir_continues_after_its_last_checkpoint(trained, capsys, caplog):
    cfg, wd = trained
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "wd2", "--resume", str(wd),
                       "--cfg-options", "train_cfg.max_epochs=3")
    assert code == 0, err
    assert f"Resumed from {wd / 'epoch_2.pth'} at epoch 3, iteration 4" in caplog.messages
    assert (Path("wd2") / "epoch_3.pth").is_file() and not (Path("wd2") / "epoch_1.pth").exists()


def test_a_refused_run_leaves_no_folder_behind(trained, capsys, caplog):
    cfg, _ = trained
    Path("empty").mkdir()
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "new/w", "--resume", "empty")
    assert code == 2 and len(err) == 1 and "empty: a directory without a checkpoint" in err[0]
    assert any(m.startswith("memfit: torch") for m in caplog.messages)  # the runner was built, its folder made
    assert not Path("new").exists()  # nor work_dir's parent, created by this run
    Path("w").mkdir()
    (Path("w") / "notes.txt").write_text("mine")
    code, err, _ = cli(capsys, "train", cfg, "--work-dir", "w", "--cfg-options", "optim_wrapper.optimizer.lr=-1")
    assert code == 2 and len(err) == 1 and "invalid learning rate: -1" in err[0]
    assert sorted(os.listdir("w")) == ["notes.txt"]  # a work dir that was there stays, with what it held


def test_auto_scale_lr_enables_the_configs_rule(tmp_path, capsys, caplog):
    cfg = tmp_path / "cfg.py"
    scaled = "auto_scale_lr = dict(enable=False, base_batch_size=2)\n"
    cfg.write_text(CFG.replace("max_epochs=2", "max_epochs=1") + scaled)
    assert cli(capsys, "train", str(cfg), "--work-dir", "w", "--auto-scale-lr")[0] == 0
    assert "auto_scale_lr: lr scaled by 4/2 to 2.0000e-01" in caplog.messages
    cfg.write_text(CFG)
    code, err, _ = cli(capsys, "train", str(cfg), "--work-dir", "w2", "--auto-scale-lr")
    assert code == 2 and err == [f"memfit: error: {cfg}: --auto-scale-lr: the config sets no "
                                 "auto_scale_lr.base_batch_size: add auto_scale_lr = dict(enable=False, "
                                 "base_batch_size=N), N the total batch size its lr is for"]
    assert not Path("w2").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"memfit {__version__} (torch {torch.__version__})\n"


def test_help_texts_show_no_markup_and_say_what_plan_writes():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    texts = {name: p.format_help() for name, p in subparsers.items()}
    assert not any("``" in text for text in [parser.format_help(), *texts.values()])
    plan_work_dir = " ".join(texts["plan"].split("--work-dir WORK_DIR")[2].split())
    assert plan_work_dir.startswith("where plan writes its chart, plan.png") and "checkpoints" not in plan_work_dir
