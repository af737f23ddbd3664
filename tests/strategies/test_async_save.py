"""FSDPStrategy(async_save=True): sharded checkpoints written in the background at world size 2
become visible (and ``last_checkpoint`` moves) only once complete; a crash during a write leaves the
previous checkpoint as the last one, and resuming from it matches the uninterrupted run."""

import os
from pathlib import Path

import pytest

from memfit.checkpoint import is_dcp_checkpoint, read_latest
from memfit.testing import launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "train_resume.py"
TOL = 1e-5  # as tests/strategies/test_sharded_resume.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    out = root / "out"
    cwd = os.getcwd()
    os.chdir(root)
    try:
        # An uninterrupted sync and async run; an async run that crashes before iteration 9 (iter_8
        # still being written); that run resumed from last_checkpoint.
        proc = launch(SCRIPT, 2, ["A", "fsdp:sync", "fsdp_async:async", "fsdp_async:crash::9",
                                  "fsdp_async:crash:auto"], out_dir=out, timeout=240)
        a = read_results(out, 2, proc, name="A")[0]
    finally:
        os.chdir(cwd)
    return root, a


def test_async_run_matches_sync_and_publishes_complete_checkpoints(runs):
    root, a = runs
    sync, run = a["fsdp:sync"], a["fsdp_async:async"]
    assert [r[0] for r in run["rows"]] == list(range(1, 10))
    for (it, loss, seen), (it2, loss2, seen2) in zip(sync, run["rows"]):
        assert it == it2 and seen == seen2 and abs(loss - loss2) <= TOL, (it, loss, loss2)
    visible = {int(k): v for k, v in run["visible"].items()}
    # iter_4 is written in the background: not under its final name, nor last, until the next save.
    assert visible[5] == [[], None]
    assert visible[9] == [["iter_4.pth"], "iter_4.pth"]
    work = root / "async"
    assert read_latest(work) == work / "iter_9.pth"  # finalized at the end of training
    for n in (4, 8, 9):
        assert is_dcp_checkpoint(work / f"iter_{n}.pth")
        assert (work / f"iter_{n}.pth" / "memfit_state.pth").is_file()
    assert not [p for p in work.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_crash_during_async_write_keeps_previous_and_resumes(runs):
    root, a = runs
    crashed, resumed = a["fsdp_async:crash"], a["fsdp_async:crash:resumed"]
    assert [r[0] for r in crashed["rows"]] == list(range(1, 9))
    # The crash came while iter_8 was pending: iter_4 stayed the last checkpoint, and the resumed
    # run (from last_checkpoint) started there.
    assert {int(k): v for k, v in resumed["visible"].items()}[5] == [["iter_4.pth"], "iter_4.pth"]
    full = a["fsdp_async:async"]["rows"]
    assert [r[0] for r in resumed["rows"]] == [5, 6, 7, 8, 9]
    for (it, loss, seen), (it2, loss2, seen2) in zip(full[4:], resumed["rows"]):
        assert it == it2 and seen == seen2, (it, seen, seen2)
        assert abs(loss - loss2) <= TOL, (it, loss, loss2)
    work = root / "crash"
    assert read_latest(work) == work / "iter_9.pth"
    assert is_dcp_checkpoint(work / "iter_9.pth") and (work / "iter_9.pth" / "memfit_state.pth").is_file()
