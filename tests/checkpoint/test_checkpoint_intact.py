"""checkpoint.intact: which checkpoints are whole, judged without reading a tensor."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from memfit.checkpoint import save_checkpoint, write_latest
from memfit.checkpoint.intact import choose_checkpoint, damage
from memfit.errors import CheckpointError


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _sharded(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process" is intended
        dcp.save({"state_dict": {"w": torch.randn(64, 64)}}, checkpoint_id=path)
    save_checkpoint({"meta": {}, "loop": {"iter": 1}}, path / "memfit_state.pth")
    return path


def test_files(tmp_path):
    good = tmp_path / "good.pth"
    save_checkpoint({"meta": {}, "w": torch.randn(256)}, good)
    assert damage(good) is None
    legacy = tmp_path / "legacy.pth"  # no index to check: left to the load
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert damage(legacy) is None
    assert damage(tmp_path / "gone.pth") == "it does not exist"
    (tmp_path / "empty.pth").write_bytes(b"")
    assert damage(tmp_path / "empty.pth") == "empty: 0 bytes"
    _cut(good, 0.5)
    assert damage(good).startswith("truncated or corrupt: ")
    (tmp_path / "text.pth").write_text("hello")
    assert damage(tmp_path / "text.pth") == "not a torch file (5 bytes)"


@pytest.mark.parametrize(("fault", "why"), [
    (lambda d: (d / "__0_0.distcp").unlink(), "shard __0_0.distcp is missing"),
    (lambda d: _cut(d / "__0_0.distcp", 0.5), "shard __0_0.distcp is truncated ("),
    (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    (lambda d: _cut(d / ".metadata", 0.5), ".metadata is unreadable ("),
    (lambda d: (d / "memfit_state.pth").unlink(), "memfit_state.pth is missing"),
    (lambda d: (d / "memfit_state.pth").write_bytes(b""), "memfit_state.pth: empty: 0 bytes"),
    (lambda d: None, None),
], ids=["no_shard", "short_shard", "no_metadata", "short_metadata", "no_extras", "empty_extras", "intact"])
def test_sharded_directories(tmp_path, fault, why):
    path = _sharded(tmp_path / "iter_1.pth")
    fault(path)
    assert damage(path) == why if why is None else damage(path).startswith(why)


def test_other_backends_directories(tmp_path):
    """DeepSpeed-like: extras plus the backend's .pt files, each checked as a file."""
    path = tmp_path / "iter_1.pth"
    save_checkpoint({"meta": {}}, path / "memfit_state.pth")
    assert damage(path) == "it holds only memfit_state.pth: its shards are missing"
    save_checkpoint({"module": {"w": torch.ones(2)}}, path / "engine" / "mp_rank_00_model_states.pt")
    assert damage(path) is None
    _cut(path / "engine" / "mp_rank_00_model_states.pt", 0.5)
    assert damage(path).startswith("engine/mp_rank_00_model_states.pt: truncated or corrupt")


def test_choice_order(tmp_path):
    for n in (1, 2, 3):
        save_checkpoint({"meta": {}, "n": n}, tmp_path / f"iter_{n}.pth")
    best = tmp_path / "best_acc_iter_2.pth"
    save_checkpoint({"meta": {}}, best)
    write_latest(tmp_path, best.name)  # the pointer's target first, whatever its name
    assert choose_checkpoint(tmp_path).path == best and choose_checkpoint(tmp_path).warning is None
    best.write_bytes(b"")
    choice = choose_checkpoint(tmp_path)
    assert choice.path == tmp_path / "iter_3.pth"
    assert choice.warning == f"{best} is damaged (empty: 0 bytes): resuming from iter_3.pth instead"
    (tmp_path / "last_checkpoint").unlink()
    assert choose_checkpoint(tmp_path).warning.startswith(f"{tmp_path / 'last_checkpoint'} is missing or empty")
    assert choose_checkpoint(tmp_path / "nothing").path is None
    for n in (1, 2, 3):
        _cut(tmp_path / f"iter_{n}.pth", 0.5)
    with pytest.raises(CheckpointError, match="no intact checkpoint to resume from"):
        choose_checkpoint(tmp_path)
