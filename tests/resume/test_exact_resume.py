"""Exact resume after SIGKILL: the losses after a resume equal an uninterrupted run's, bit for bit.

Each run is a process of its own (scripts/train_run.py: dropout, random crops and flips, bf16 autocast,
AdamW, warm-up + cosine schedule, accumulation k=3, validation with save_best, max_keep_ckpts=2)
that appends ``iteration float.hex(loss)`` per iteration to a log. A chain of runs in one work dir
is killed at several positions and resumed with ``resume=True`` each time; every loss any of those
runs recorded must equal the reference run's loss at that iteration, and the final weights must be
identical. Both tests' references and chains are forked, run after run, from one parent that imported torch
and memfit once (the imports were most of each run's time).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from memfit.checkpoint import find_checkpoints, load_checkpoint, read_latest
from memfit.testing import run_forked

SCRIPT = Path(__file__).parent / "scripts" / "train_run.py"
ITERS = 30  # both configs: 40 samples / batch 4 = 10 iterations per epoch, 3 epochs or 30 iterations


def _checked(proc: subprocess.CompletedProcess, opts: dict) -> int:
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"run {opts} failed with exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode


def _segments(log: Path) -> list[tuple[int | None, list[tuple[int, str]]]]:
    """The log split into runs: (iteration it resumed at or None, [(iteration, loss hex)])."""
    segments: list[tuple[int | None, list[tuple[int, str]]]] = [(None, [])]
    for line in log.read_text().splitlines():
        key, value = line.split()
        if key == "resumed":
            segments.append((int(value), []))
        else:
            segments[-1][1].append((int(key), value))
    return segments


def _kill_points() -> dict[str, tuple[list[str], list[int], dict]]:
    """Per config: the kills (see the tests), the iterations the resumes must start at, the runs' options."""
    seed = int(os.environ.get("MEMFIT_KILL_SEED", "20261122"))  # set it to try other kill points
    k = random.Random(seed).randrange(5, ITERS - 5)  # a checkpoint every 5 iterations: one exists by then
    after = (k // 5 + 1) * 5
    return {
        "epoch": (["before:17", "after:20", "save:iter_25.pth", "pointer:iter_30.pth"], [15, 20, 20, 25],
                  dict(by_epoch=True, num_workers=0)),
        "iter": ([f"before:{k}", f"after:{after}"], [k // 5 * 5, after], dict(by_epoch=False, num_workers=2)),
    }


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, dict]:
    """Per config: an uninterrupted reference run; then, in one work dir, a run killed at each kill point and
    resumed by the next, and a last resume that completes. Every run of both configs in one run_forked call."""
    root = tmp_path_factory.mktemp("exact_resume")
    runs, plans = [], {}
    for name, (kills, expected, opts) in _kill_points().items():
        ref, chain = root / f"{name}-reference", root / f"{name}-chain"
        ref.mkdir()
        chain.mkdir()
        plans[name] = dict(ref=ref, chain=chain, kills=kills, expected=expected, first=len(runs))
        runs.append(dict(work_dir=str(ref / "work"), log=str(ref / "losses.log"), **opts))
        runs += [dict(work_dir=str(chain / "work"), log=str(chain / "losses.log"), resume=True, **opts,
                      **({"kill": kill} if kill else {})) for kill in [*kills, None]]
    procs = run_forked(SCRIPT, [[json.dumps(opts)] for opts in runs], out_dir=root / "procs",
                       timeout=240 * len(runs))
    codes = [_checked(proc, opts) for proc, opts in zip(procs, runs)]
    for plan in plans.values():
        first = plan.pop("first")
        plan["codes"] = codes[first:first + len(plan["kills"]) + 2]  # the reference's, then the chain's
    return plans


def _check_chain(plan: dict) -> None:
    ref_code, *codes = plan["codes"]
    kills, expected_resumes = plan["kills"], plan["expected"]
    assert ref_code == 0
    ref_losses = dict(_segments(plan["ref"] / "losses.log")[0][1])
    assert sorted(ref_losses) == list(range(ITERS))
    ref_dir, work, log = plan["ref"] / "work", plan["chain"] / "work", plan["chain"] / "losses.log"
    for code, kill in zip(codes, kills):
        assert code == -signal.SIGKILL, f"kill {kill} did not happen"
    assert codes[-1] == 0

    segments = _segments(log)
    assert [start for start, _ in segments] == [None, *expected_resumes], f"kills {kills}"
    for (start, records), kill in zip(segments, [*kills, "none"]):
        # No replay, no skip: a resumed run's first iteration is the first one the checkpoint lacks.
        if start is not None and records:
            assert records[0][0] == start
        for it, loss in records:
            assert loss == ref_losses[it], (
                f"iteration {it} (run resumed at {start}, killed at {kill}): loss {float.fromhex(loss)!r} "
                f"!= uninterrupted {float.fromhex(ref_losses[it])!r}"
            )
    assert max(it for _, records in segments for it, _ in records) == ITERS - 1

    final, ref_final = load_checkpoint(work / f"iter_{ITERS}.pth"), load_checkpoint(ref_dir / f"iter_{ITERS}.pth")
    for key, value in ref_final["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key
    # max_keep_ckpts=2 held across the restarts; no partial file of the interrupted save is left.
    assert [p.name for p in find_checkpoints(work)] == [f"iter_{ITERS - 5}.pth", f"iter_{ITERS}.pth"]
    assert not [p.name for p in work.iterdir() if ".tmp-" in p.name]
    assert read_latest(work) == work / f"iter_{ITERS}.pth"


def test_epoch_based_kills_resume_bit_exact(chains):
    """Epoch-based, num_workers=0. Kills: mid-epoch with iter_15 (inside an accumulation window:
    15 % 3 != 0 in epoch 2) as the last checkpoint; right after saving iter_20 (an epoch end, before
    its validation); during the write of iter_25 (the previous checkpoint must serve); after iter_30
    is written but before last_checkpoint names it (resumes from iter_25, inside a window)."""
    _check_chain(chains["epoch"])


def test_iteration_based_random_kill_resume_bit_exact(chains):
    """Iteration-based, num_workers=2: a kill at a random iteration (MEMFIT_KILL_SEED), then one right after
    the save of iter_K that follows it."""
    _check_chain(chains["iter"])
