"""Export to safetensors from file and sharded (DCP) checkpoints; safe reading of DCP directories."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import memfit
from memfit.checkpoint import export_safetensors, load_weights, read_dcp, save_checkpoint
from memfit.errors import CheckpointError


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied: two keys, one storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(x)))


class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model() -> TiedNet:
    torch.manual_seed(0)
    net = TiedNet()
    net.norm.running_var.mul_(3.0)
    return net


def _full_state(net: nn.Module) -> dict:
    opt = torch.optim.AdamW(net.parameters())
    net(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    return {
        "state_dict": net.state_dict(),
        "optimizer": opt.state_dict(),
        "meta": {"epoch": 2, "cfg": {"a": [1]}},
    }


def _dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process" is intended
        dcp.save(state, checkpoint_id=str(path))


def test_export_round_trip_from_file(tmp_path: Path) -> None:
    net = _model()
    state = _full_state(net)
    save_checkpoint(state, tmp_path / "epoch_2.pth")
    out = export_safetensors(tmp_path / "epoch_2.pth", tmp_path / "export" / "model.safetensors")
    assert out == tmp_path / "export" / "model.safetensors"
    loaded = load_file(out)
    expected = net.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype, key
    with safe_open(out, framework="pt") as f:
        meta = f.metadata()
    assert meta["memfit_version"] == memfit.__version__
    assert meta["source"] == str((tmp_path / "epoch_2.pth").resolve())
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # no temp left
    fresh = TiedNet()
    assert load_weights(fresh, out) == ([], [])
    assert torch.equal(fresh.out.weight, net.embed.weight)


def test_export_non_contiguous_and_bf16(tmp_path: Path) -> None:
    base = torch.randn(4, 6)
    sd = {"t": base.t(), "h": torch.randn(3, dtype=torch.bfloat16)}
    save_checkpoint({"state_dict": sd}, tmp_path / "c.pth")
    loaded = load_file(export_safetensors(tmp_path / "c.pth", tmp_path / "c.safetensors"))
    assert torch.equal(loaded["t"], base.t()) and torch.equal(loaded["h"], sd["h"])


def test_export_round_trip_from_sharded_directory(tmp_path: Path) -> None:
    net = _model()
    state = _full_state(net)
    _dcp_save(state, tmp_path / "epoch_2")
    loaded = load_file(export_safetensors(tmp_path / "epoch_2", tmp_path / "model.safetensors"))
    expected = net.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    # read_dcp reads everything, or only the named top-level entries.
    everything = read_dcp(tmp_path / "epoch_2")
    assert everything["meta"] == {"epoch": 2, "cfg": {"a": [1]}}
    assert set(read_dcp(tmp_path / "epoch_2", keys={"meta"})) == {"meta"}


def test_sharded_plain_state_dict_loads_as_weights(tmp_path: Path) -> None:
    net = _model()
    _dcp_save(net.state_dict(), tmp_path / "weights")
    fresh = TiedNet()
    assert load_weights(fresh, tmp_path / "weights") == ([], [])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())


def test_hostile_dcp_metadata_is_refused_and_not_run(tmp_path: Path) -> None:
    _dcp_save({"state_dict": _model().state_dict()}, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsShell(marker), protocol=2))
    with pytest.raises(CheckpointError) as excinfo:
        export_safetensors(tmp_path / "ckpt", tmp_path / "out.safetensors")
    msg = str(excinfo.value)
    assert "refuses to unpickle object 'os.system'" in msg and str(tmp_path / "ckpt") in msg
    assert "\n" not in msg
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_hostile_dcp_object_entry_is_refused_and_not_run(tmp_path: Path) -> None:
    # torch's own DCP reader would torch.load(weights_only=False) this entry and run os.system.
    marker = tmp_path / "pwned"
    _dcp_save({"state_dict": _model().state_dict(), "extra": _RunsShell(marker)}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="cannot read sharded checkpoint") as excinfo:
        read_dcp(tmp_path / "ckpt")
    assert "refuses to unpickle object 'os.system'" in str(excinfo.value)
    assert not marker.exists()
    # The model weights alone are still readable: the hostile entry is never touched.
    assert set(read_dcp(tmp_path / "ckpt", keys={"state_dict"})) == {"state_dict"}
    assert not marker.exists()


def test_export_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'none.pth'} does not exist"):
        export_safetensors(tmp_path / "none.pth", tmp_path / "o.safetensors")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointError, match="empty_dir: a directory without a checkpoint: give a checkpoint file"):
        export_safetensors(tmp_path / "empty_dir", tmp_path / "o.safetensors")
