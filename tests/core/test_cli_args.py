"""The command line's own values are refused before any work, in one line naming the flag and what it takes: counts
below one, a port out of range, and output files that are folders, of a kind the command cannot write, or where no
file can be made (memfit/cli_args.py). Each case would otherwise plan, measure, train or export first and then fail
with a bare Python error, or do something else than asked (``train --gpus 0`` trained on one process). A chart
name without a suffix: tests/planner/test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.cli import main

CFG = """
model = dict(type='ImageClassifier', backbone=dict(type='torch.nn.Linear', in_features=16, out_features=2))
train_dataloader = dict(batch_size=4, dataset=dict(type='ShapesDataset', num_samples=8, image_size=16, num_classes=2))
train_cfg = dict(by_epoch=True, max_epochs=1)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))
"""

# (argv, with C the config and F a regular file, the message after "memfit: error: [C: ]")
CASES = [
    ("plan C --gpus 0", "--gpus 0: give the number of ranks per machine (at least 1)"),
    ("plan C --nodes -1", "--nodes -1: give the number of machines (at least 1)"),
    ("plan C --top 0", "--top 0: give the number of rows to print (at least 1)"),
    ("plan C --json .", "--json .: a folder: give a file path, e.g. plan.json"),
    ("plan C --png out/chart.txt", "--png out/chart.txt: not a .pdf, .png, .svg, ... file: give e.g. out/plan.png"),
    ("plan C --png F/chart.png", "--png F/chart.png: cannot write there ({F}: not a folder): give a path in a "
                                 "writable folder"),
    ("plan C --work-dir F/w", "--work-dir F/w/plan.png: cannot write there ({F}: not a folder): give a path in a "
                              "writable folder"),
    ("bench C --steps 0", "--steps 0: give the number of timed steps per plan (at least 1)"),
    ("bench C --out F/bench", "--out F/bench.csv: cannot write there ({F}: not a folder): give a path in a writable "
                              "folder"),
    ("train C --gpus 0", "--gpus 0: give the number of processes per machine (at least 1)"),
    ("train C --gpus 2 --nnodes 0", "--nnodes 0: give the number of machines (at least 1)"),
    ("train C --gpus 2 --master-port 99999", "--master-port 99999: give a free TCP port of node 0, 1 to 65535 "
                                             "(default 29500)"),
    ("export w --out .", "--out .: a folder: give a file path, e.g. model.safetensors"),
    ("convert C --out F/c.py", "--out F/c.py: cannot write there ({F}: not a folder): give a path in a writable "
                               "folder"),
    ("convert C --out c.txt", "--out c.txt: not a .py, .yaml, .yml file: give e.g. config.py"),
    ("data shapes-coco --out d --num 0", "--num 0: give the number of images (at least 1)"),
    ("data shapes-coco --out F", "--out F: a file, not a folder: give a folder to write in"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[c[0] for c in CASES])
def test_a_bad_value_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    Path("cfg.py").write_text(CFG)
    Path("F").write_text("a file")
    args = [{"C": "cfg.py"}.get(a, a) for a in argv.split()]
    assert main(args) == 2
    out = capsys.readouterr()
    prefix = "cfg.py: " if "C" in argv.split() else ""
    assert out.err.splitlines() == [f"memfit: error: {prefix}{message.format(F=tmp_path / 'F')}"]
    assert not out.out  # nothing planned, measured or written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F", "cfg.py"]

