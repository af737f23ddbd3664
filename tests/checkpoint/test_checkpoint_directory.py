"""Directory checkpoints (FSDP, DeepSpeed, colossalai): atomic publish, a kill at any point leaves a
loadable checkpoint, leftovers are recognised and cleaned, one extras file name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.checkpoint import read_latest, write_latest
from memfit.checkpoint.directory import (
    EXTRAS_FILE,
    TEMP_PATTERN,
    StateRef,
    read_extras,
    recover,
    save_directory,
    split_state,
)


def _write_shards(value: float):
    def write(tmp: Path) -> None:
        torch.save({"w": torch.full((4,), value)}, tmp / "shard_0.pt")
    return write


def _value(path: Path) -> float:
    return float(torch.load(path / "shard_0.pt", weights_only=True)["w"][0])


def test_save_publishes_shards_and_extras_and_replaces_atomically(tmp_path):
    ckpt = tmp_path / "best.pth"
    save_directory(ckpt, {"loop": {"iter": 1}}, _write_shards(1.0))
    assert _value(ckpt) == 1.0 and read_extras(ckpt)["loop"] == {"iter": 1}
    assert (ckpt / EXTRAS_FILE).is_file()
    save_directory(ckpt, {"loop": {"iter": 2}}, _write_shards(2.0))  # the same name again
    assert _value(ckpt) == 2.0 and read_extras(ckpt)["loop"] == {"iter": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["best.pth"]  # no temp or set-aside copy left


def test_split_state_keeps_tensors_out_of_the_extras(caplog):
    state = {"state_dict": StateRef(None, "model"), "meta": {"a": 1}, "grads": [{"w": torch.ones(1)}],
             "optim_wrapper": {"optimizer": StateRef(None, "optimizer"), "inner_count": 3}}
    with caplog.at_level("WARNING", logger="memfit"):
        tensors, extras = split_state(state)
    assert set(tensors) == {"state_dict", "optimizer"}
    assert extras == {"meta": {"a": 1}, "optim_wrapper": {"inner_count": 3}}
    assert "inside an accumulation window" in caplog.text


# A save killed (SIGKILL-like: os._exit, no cleanup runs) at a chosen point of publish().
_KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    from memfit.checkpoint import write_latest
    from memfit.checkpoint import directory
    work, point = Path(sys.argv[1]), sys.argv[2]
    real_replace = os.replace
    def replace(src, dst):
        if point == "after_set_aside" and Path(src).is_dir() and Path(dst).name == "epoch_1.pth":
            assert not Path(dst).exists()  # the old checkpoint is set aside, the new one not renamed in yet
            os._exit(9)
        return real_replace(src, dst)
    def write(tmp):
        torch.save({"w": torch.full((4,), 2.0)}, tmp / "shard_0.pt")
        if point == "during_write":
            os._exit(9)
    directory.os.replace = replace
    directory.save_directory(work / "epoch_1.pth", {"loop": {"iter": 2}}, write)
    write_latest(work, "epoch_1.pth")
""")


@pytest.mark.parametrize("point", ["during_write", "after_set_aside"])
def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, point):
    work = tmp_path / "work"
    save_directory(work / "epoch_1.pth", {"loop": {"iter": 1}}, _write_shards(1.0))
    write_latest(work, "epoch_1.pth")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(work), point], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    leftovers = sorted(p.name for p in work.iterdir() if TEMP_PATTERN.match(p.name))
    assert leftovers  # the killed save's temporary (and, after set-aside, the old copy) are there
    # Before any cleanup a resume still finds the previous checkpoint, complete.
    found = read_latest(work)
    assert _value(found) == 1.0 and read_extras(found)["loop"] == {"iter": 1}
    # The cleanup at the next start puts it back under its name and removes the rest.
    touched = recover(work)
    assert sorted(p.name for p, _ in touched) == leftovers
    assert sorted(action for _, action in touched) == (["removed", "restored"] if point == "after_set_aside"
                                                       else ["removed"])
    assert sorted(p.name for p in work.iterdir()) == ["epoch_1.pth", "last_checkpoint"]
    assert _value(read_latest(work)) == 1.0


def test_recover_removes_temp_names_of_every_writer(tmp_path):
    (tmp_path / ".iter_4.pth.tmp-1a2b3c4d").mkdir()  # a directory save (hex token)
    (tmp_path / ".epoch_2.pth.tmp-12345").write_bytes(b"partial")  # an atomic file write (pid)
    (tmp_path / "epoch_3.pth").mkdir()
    (tmp_path / ".epoch_3.pth.old-00ff00ff").mkdir()  # superseded: its replacement arrived
    assert len(recover(tmp_path)) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["epoch_3.pth"]


class _FakeBooster:
    """colossalai's Booster checkpoint I/O, writing small files (the sharded plugins need CUDA)."""

    def save_model(self, model, path, shard=True):
        Path(path).mkdir()
        torch.save({"w": torch.full((2,), model)}, Path(path) / "model.bin")

    def save_optimizer(self, optimizer, path, shard=True):
        Path(path).mkdir()
        torch.save({"step": optimizer}, Path(path) / "optim.bin")


_KILLED_COLOSSAL_SAVE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint_directory import _FakeBooster
    from memfit.checkpoint import directory
    from memfit.strategies.colossalai import ColossalAIStrategy
    real_replace = os.replace
    def replace(src, dst):
        if Path(src).is_dir() and Path(dst).name == "epoch_1.pth":
            assert not Path(dst).exists()  # the old checkpoint is set aside, the new one not renamed in yet
            os._exit(9)
        return real_replace(src, dst)
    directory.os.replace = replace
    s = ColossalAIStrategy(plugin="gemini")
    s.booster, s._boosted = _FakeBooster(), (2.0, 2)
    s.save_checkpoint(Path(sys.argv[1]) / "epoch_1.pth", {"state_dict": None, "meta": {"n": 2},
                                                         "optim_wrapper": {"optimizer": None, "inner_count": 2}})
""")


def test_colossalai_sharded_save_is_atomic(tmp_path):
    """The booster's sharded files go through the same directory save: killed between moving the old
    checkpoint aside and renaming the new one in, the previous checkpoint still loads."""
    from memfit.strategies.colossalai import ColossalAIStrategy

    work = tmp_path / "work"
    s = ColossalAIStrategy(plugin="gemini")
    s.booster, s._boosted = _FakeBooster(), (1.0, 1)
    s.save_checkpoint(work / "epoch_1.pth", {"state_dict": None, "meta": {"n": 1},
                                             "optim_wrapper": {"optimizer": None, "inner_count": 1}})
    write_latest(work, "epoch_1.pth")
    state = s.load_checkpoint(work / "epoch_1.pth")
    assert state["meta"] == {"n": 1} and isinstance(state["state_dict"], StateRef)
    proc = subprocess.run([sys.executable, "-c", _KILLED_COLOSSAL_SAVE, str(work), str(Path(__file__).parent)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert not (work / "epoch_1.pth").exists()  # killed mid-publish
    found = read_latest(work)
    assert s.load_checkpoint(found)["meta"] == {"n": 1}
    recover(work)
    state = s.load_checkpoint(read_latest(work))
    assert state["meta"] == {"n": 1} and state["state_dict"].path == work / "epoch_1.pth" / "model"
    assert float(torch.load(work / "epoch_1.pth" / "model" / "model.bin", weights_only=True)["w"][0]) == 1.0
