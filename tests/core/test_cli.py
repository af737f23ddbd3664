"""The memfit command: train from a config file, --cfg-options, the dumped config, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from memfit.cli import main
from memfit.config import Config

CFG = '''
_data = dict(type='ShapesDataset', image_size=16, num_classes=2)
model = dict(type='TimmClassifier', model_name='resnet10t', num_classes=2)
train_dataloader = dict(batch_size=8, dataset=dict(**_data, num_samples=32))
val_dataloader = dict(batch_size=16, sampler=dict(type='DefaultSampler', shuffle=False),
                      dataset=dict(**_data, num_samples=16, split='val'))
val_evaluator = dict(type='Accuracy')
val_cfg = dict()
train_cfg = dict(by_epoch=True, max_epochs=1)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01))
default_hooks = dict(logger=dict(interval=1))
randomness = dict(seed=0)
'''


def test_train_with_cfg_options_round_trips_into_dumped_config(tmp_path, capsys):
    cfg = tmp_path / "small.py"
    cfg.write_text(CFG)
    rc = main(["train", str(cfg), "--work-dir", "wd", "--amp", "--cfg-options",
               "optim_wrapper.accumulative_counts=2", "train_cfg.max_epochs=2", "optim_wrapper.dtype=bfloat16"])
    assert rc == 0
    dumped = Config.fromfile(next(Path("wd").glob("*/config.py")))
    assert dumped.optim_wrapper.accumulative_counts == 2 and dumped.optim_wrapper.type == "AmpOptimWrapper"
    assert dumped.train_cfg.max_epochs == 2 and dumped.optim_wrapper.optimizer.lr == 0.01
    rows = [json.loads(x) for x in next(Path("wd").glob("*/scalars.jsonl")).read_text().splitlines()]
    assert [r["iter"] for r in rows if "loss" in r] == list(range(1, 9))
    assert any("val/accuracy/top1" in r for r in rows)
    assert (Path("wd") / "epoch_2.pth").is_file()
    out = capsys.readouterr().out
    assert "Epoch(train)  [2][4/4]" in out and "Epoch(val) [2][1/1]" in out


def test_config_typo_is_one_line_error(tmp_path):
    cfg = tmp_path / "typo.py"
    cfg.write_text(CFG.replace("train_cfg =", "trian_cfg ="))
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", str(cfg)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "trian_cfg" in lines[0] and "did you mean 'train_cfg'" in lines[0], proc.stderr


def test_bad_cfg_option_and_missing_file_are_one_line_errors(tmp_path, capsys):
    cfg = tmp_path / "small.py"
    cfg.write_text(CFG)
    assert main(["train", str(cfg), "--cfg-options", "optim_wrapper.optimizer.type=SDG"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'SGD'" in err[0]
    assert main(["train", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.py" in err[0]


def test_eval_and_export(tmp_path, capsys):
    cfg = tmp_path / "small.py"
    cfg.write_text(CFG)
    assert main(["train", str(cfg), "--work-dir", "wd"]) == 0
    capsys.readouterr()
    assert main(["eval", str(cfg), "--work-dir", "wd2", "--checkpoint", "wd/epoch_1.pth"]) == 0
    assert "accuracy/top1:" in capsys.readouterr().out
    assert main(["export", "wd/epoch_1.pth", "--out", "m.safetensors"]) == 0
    weights = load_file("m.safetensors")
    state = torch.load("wd/epoch_1.pth", weights_only=True)["state_dict"]
    assert set(weights) == set(state) and all(torch.equal(weights[k], state[k]) for k in state)
