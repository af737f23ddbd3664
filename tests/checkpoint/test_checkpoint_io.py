"""Atomic checkpoint writes, plain-data validation and safe (weights_only) loading."""

from __future__ import annotations

import collections
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit.checkpoint import (
    check_plain,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    to_plain,
    write_latest,
)
from memfit.errors import CheckpointError


class _RunsShell:
    """Pickles as a call to os.system: loading it unsafely would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _RunsEval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


class _SomeClass:
    pass


def _one_line_error(excinfo: pytest.ExceptionInfo, path: Path) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert str(path) in msg
    return msg


# ---------------------------------------------------------------- round trip and validation


def test_round_trip_keeps_tensors_and_plain_data(tmp_path: Path) -> None:
    state = {
        "state_dict": collections.OrderedDict(w=torch.randn(3, 4), b=torch.arange(3, dtype=torch.bfloat16)),
        "meta": {"epoch": 3, "lr": 0.1, "name": "x", "ok": True, "none": None, "shape": torch.Size([2, 3])},
        "groups": [{"params": [0, 1], "betas": (0.9, 0.999)}],
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    path = tmp_path / "epoch_3.pth"
    save_checkpoint(state, path)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
    assert loaded["state_dict"]["b"].dtype == torch.bfloat16
    assert loaded["meta"] == state["meta"]
    assert loaded["groups"] == [{"params": [0, 1], "betas": (0.9, 0.999)}]
    assert torch.equal(loaded["param"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["epoch_3.pth"]  # no temporary file left behind


@pytest.mark.parametrize(
    "value, type_name",
    [
        (torch.nn.Linear, "<class 'type'>"),
        (np.float64(1.5), "numpy.float64"),
        (collections.namedtuple("Pair", "a b")(1, 2), "Pair"),
        (torch.float16, "torch.dtype"),
        ({1, 2}, "<class 'set'>"),
    ],
)
def test_non_plain_value_is_named_by_key_path(tmp_path: Path, value: object, type_name: str) -> None:
    state = {"meta": {"cfg": {"model": {"type": value}}}}
    with pytest.raises(CheckpointError, match=r"'meta\.cfg\.model\.type'") as excinfo:
        save_checkpoint(state, tmp_path / "a.pth")
    assert type_name in str(excinfo.value)
    assert "\n" not in str(excinfo.value)
    assert not list(tmp_path.iterdir())  # validated before anything was written


def test_list_index_and_key_type_are_reported() -> None:
    with pytest.raises(CheckpointError, match=r"'groups\[1\]\.fn'"):
        check_plain({"groups": [{"fn": 1}, {"fn": print}]})
    with pytest.raises(CheckpointError, match=r"key 'm\.\(1, 2\)' is a <class 'tuple'>"):
        check_plain({"m": {(1, 2): 0}})


def test_to_plain_makes_config_values_saveable(tmp_path: Path) -> None:
    def schedule(step: int) -> float:
        return 1.0

    cfg = {
        "model": {"type": torch.nn.Linear, "dims": (3, 4)},
        "fn": schedule,
        "np": {"f": np.float32(0.5), "i": np.int64(7), "a": np.arange(3)},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "path": Path("/data/x"),
        "other": object(),
        (1, 2): "tuple key",
    }
    plain = to_plain(cfg)
    assert plain["model"] == {"type": "torch.nn.modules.linear:Linear", "dims": [3, 4]}
    assert plain["fn"].endswith(":test_to_plain_makes_config_values_saveable.<locals>.schedule")
    assert plain["np"]["f"] == 0.5 and type(plain["np"]["f"]) is float
    assert plain["np"]["i"] == 7 and type(plain["np"]["i"]) is int
    assert torch.equal(plain["np"]["a"], torch.arange(3))
    assert plain["dtype"] == "torch.bfloat16" and plain["device"] == "cpu" and plain["path"] == "/data/x"
    assert plain["other"].startswith("<object object at")
    assert plain["[1, 2]"] == "tuple key"
    save_checkpoint({"meta": {"cfg": plain}}, tmp_path / "a.pth")
    assert load_checkpoint(tmp_path / "a.pth")["meta"]["cfg"]["model"]["dims"] == [3, 4]


def test_failed_write_keeps_previous_file_and_removes_temp(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "latest.pth"
    save_checkpoint({"v": torch.tensor(1)}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="cannot write .*latest.pth: disk full") as exc:
        save_checkpoint({"v": torch.tensor(2)}, path)
    assert isinstance(exc.value.__cause__, OSError)
    monkeypatch.undo()
    assert load_checkpoint(path)["v"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pth"]


# ---------------------------------------------------------------- kill -9 during a write

_WRITER = textwrap.dedent(
    """
    import sys, torch
    from memfit.checkpoint import save_checkpoint, write_latest
    work_dir, target = sys.argv[1], sys.argv[2]
    first = {"state_dict": {"w": torch.full((4,), 1.0)}, "meta": {"iter": 1}}
    save_checkpoint(first, f"{work_dir}/iter_1.pth")
    write_latest(work_dir, "iter_1.pth")
    print("first-saved", flush=True)
    big = torch.ones(50 * 1024 * 1024)  # 200 MB of float32: the write takes long enough to be interrupted
    save_checkpoint({"state_dict": {"w": big}, "meta": {"iter": 2}}, f"{work_dir}/{target}")
    write_latest(work_dir, target)
    print("second-saved", flush=True)
    """
)


@pytest.mark.parametrize("target", ["iter_2.pth", "iter_1.pth"], ids=["new-file", "overwrite"])
def test_kill_during_write_leaves_previous_checkpoint_loadable(tmp_path: Path, target: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), target], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout.readline().strip() == "first-saved"
    tmp_file = tmp_path / f".{target}.tmp-{proc.pid}"
    killed_at = None
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if tmp_file.exists():
            size = tmp_file.stat().st_size
            time.sleep(0.001)
            grown = tmp_file.exists() and tmp_file.stat().st_size > size > 0
            if grown:
                proc.send_signal(signal.SIGKILL)
                killed_at = size
                break
        else:
            time.sleep(0.0005)
    proc.wait(timeout=30)
    assert killed_at is not None, "the writer finished before it could be killed mid-write"
    assert proc.returncode == -signal.SIGKILL
    # The kill interrupted the write: a partial temp file exists, nothing partial under a final name.
    assert tmp_file.exists() and tmp_file.stat().st_size < 200 * 1024 * 1024
    assert not (tmp_path / "iter_2.pth").exists()
    latest = read_latest(tmp_path)
    assert latest == tmp_path / "iter_1.pth"
    state = load_checkpoint(latest)
    assert state["meta"] == {"iter": 1} and torch.equal(state["state_dict"]["w"], torch.full((4,), 1.0))


def test_pointer_is_written_atomically_and_relative(tmp_path: Path) -> None:
    save_checkpoint({"x": 1}, tmp_path / "epoch_1.pth")
    write_latest(tmp_path, tmp_path / "epoch_1.pth")
    assert (tmp_path / "last_checkpoint").read_text() == "epoch_1.pth"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_1.pth", "last_checkpoint"]


# ---------------------------------------------------------------- refusing pickled code


def test_pickled_os_system_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": _RunsShell(marker)}, path)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    msg = _one_line_error(excinfo, path)
    assert "refuses to unpickle object 'os.system'" in msg
    assert "never executes code" in msg
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_raw_pickle_calling_eval_is_refused_and_not_run(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "raw.pth"
    path.write_bytes(pickle.dumps({"x": _RunsEval(marker)}, protocol=protocol))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    msg = _one_line_error(excinfo, path)
    # torch's weights-only unpickler names the global for protocol 2 and rejects protocol 4+ framing first.
    assert (
        ("refuses to unpickle object 'eval'" in msg) if protocol == 2 else ("not a torch checkpoint" in msg)
    )
    assert not marker.exists()


def test_arbitrary_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cls.pth"
    torch.save({"x": _SomeClass()}, path)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(path)
    assert f"refuses to unpickle object '{__name__}._SomeClass'" in _one_line_error(excinfo, path)


# ---------------------------------------------------------------- broken files


def _good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.pth"
    save_checkpoint({"w": torch.randn(4096)}, path)
    return path


@pytest.mark.parametrize(
    "make, cause",
    [
        (lambda d: d / "missing.pth", "does not exist"),
        (lambda d: d, "is a directory"),
        (lambda d: _write(d / "empty.pth", b""), "empty or truncated"),
        (lambda d: _write(d / "trunc.pth", _good_file(d).read_bytes()[:5000]), "truncated or corrupt"),
        (lambda d: _write(d / "garbage.pth", np.random.default_rng(0).bytes(2000)), "not a torch checkpoint"),
        (lambda d: _write(d / "text.pth", b"hello world\n"), "not a torch checkpoint"),
    ],
    ids=["missing", "directory", "empty", "truncated", "garbage", "text"],
)
def test_broken_files_give_one_line_errors(tmp_path: Path, make, cause: str) -> None:
    path = make(tmp_path)
    with pytest.raises(CheckpointError, match=cause) as excinfo:
        load_checkpoint(path)
    _one_line_error(excinfo, path)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_non_dict_payload_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tensor.pth"
    torch.save(torch.ones(2), path)
    with pytest.raises(CheckpointError, match="holds a Tensor, not a dict"):
        load_checkpoint(path)
