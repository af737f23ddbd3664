"""load_from: weights only, strict by default, dict form with strict/prefix/revise_keys, key report;
and ``memfit export`` of a training checkpoint to safetensors, end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from memfit import cli
from memfit.errors import CheckpointError, ConfigError


class Wrapped(nn.Module):
    """A DropoutNet under ``backbone.`` plus an extra ``neck`` (keys a strict load would reject)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.backbone = net
        self.neck = nn.Linear(2, 2)


def _equal(model: nn.Module, state: dict) -> bool:
    own = model.state_dict()
    return all(torch.equal(own[k].cpu(), v.cpu()) for k, v in state.items())  # the model may be on a GPU


def test_load_from_strict_default_reports_keys(tmp_path, kit):
    src = kit.DropoutNet(width=8)
    weights = tmp_path / "w.pth"
    torch.save({"state_dict": Wrapped(src).state_dict()}, weights)
    runner = kit.make_runner(tmp_path / "run", load_from=str(weights), train_cfg=dict(by_epoch=True, max_epochs=1))
    with pytest.raises(CheckpointError, match="strict=True") as exc:
        runner.train()
    msg = str(exc.value)
    assert "\n" not in msg and str(weights) in msg
    assert "4 missing keys [fc.bias, fc.weight, head.bias, head.weight]" in msg
    assert "6 unexpected keys" in msg


def test_load_from_dict_prefix_selects_the_backbone(tmp_path, kit):
    src = kit.DropoutNet(width=8)
    weights = tmp_path / "w.pth"
    torch.save({"state_dict": Wrapped(src).state_dict()}, weights)
    runner = kit.make_runner(tmp_path / "run", load_from=dict(path=str(weights), prefix="backbone."))
    runner.load_weights(runner.load_from)
    assert _equal(runner.model, src.state_dict())


def test_load_from_non_strict_with_revise_keys_logs_missing_and_unexpected(tmp_path, kit, capsys):
    src = kit.DropoutNet(width=8)
    renamed = {k.replace("fc.", "encoder."): v for k, v in src.state_dict().items() if not k.startswith("head.")}
    renamed["extra.weight"] = torch.zeros(1)
    weights = tmp_path / "w.pth"
    torch.save(renamed, weights)
    runner = kit.make_runner(tmp_path / "run")
    missing, unexpected = runner.load_weights(
        dict(path=str(weights), strict=False, revise_keys=[[r"^encoder\.", "fc."]]))
    assert missing == ["head.bias", "head.weight"] and unexpected == ["extra.weight"]
    assert torch.equal(runner.model.fc.weight, src.fc.weight)
    out = capsys.readouterr().out
    assert "2 missing keys [head.bias, head.weight]" in out and "1 unexpected keys [extra.weight]" in out


def test_load_from_applies_only_when_there_is_nothing_to_resume(tmp_path, kit):
    src = kit.DropoutNet(width=8)
    weights = tmp_path / "w.pth"
    torch.save(src.state_dict(), weights)
    hook = dict(type="CheckpointHook", interval=1)
    first = kit.make_runner(tmp_path / "run", load_from=str(weights), resume=True,
                            train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=dict(checkpoint=hook))
    first.train()  # no checkpoint yet: starts from the weights, then trains
    assert not _equal(first.model, src.state_dict())
    trained = {k: v.clone() for k, v in first.model.state_dict().items()}
    again = kit.make_runner(tmp_path / "run", load_from=str(weights), resume=True,
                            train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=dict(checkpoint=hook))
    again.train()  # epoch_1.pth exists: resume wins over load_from
    assert _equal(again.model, trained)


def test_load_from_dict_errors(tmp_path, kit):
    runner = kit.make_runner(tmp_path / "run")
    with pytest.raises(ConfigError, match="unknown key 'strickt': did you mean 'strict'"):
        runner.load_weights(dict(path="x.pth", strickt=False))
    with pytest.raises(ConfigError, match="give a path"):
        runner.load_weights(dict(strict=False))


def test_export_cli_writes_loadable_safetensors(tmp_path, kit, capsys):
    from safetensors.torch import load_file

    hook = dict(type="CheckpointHook", interval=1)
    runner = kit.make_runner(tmp_path / "run", train_cfg=dict(by_epoch=True, max_epochs=1),
                             default_hooks=dict(checkpoint=hook))
    runner.train()
    out = tmp_path / "export" / "model.safetensors"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "memfit", "export", str(tmp_path / "run" / "epoch_1.pth"),
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    exported = load_file(out)
    assert sorted(exported) == sorted(runner.model.state_dict())
    assert _equal(runner.model, exported)
    # The export is a valid load_from source for a fresh run.
    fresh = kit.make_runner(tmp_path / "fresh", load_from=str(out))
    fresh.load_weights(fresh.load_from)
    assert _equal(fresh.model, exported)

    # A bad source: exit status 2 and one line on stderr (in-process, the subprocess above proved the wiring).
    assert cli.main(["export", str(tmp_path / "missing.pth"), "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.pth does not exist" in err
