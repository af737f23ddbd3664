"""Fake steps in forked workers, and the fall-back to this process once forking cannot run backward."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from memfit.cli import main
from memfit.config import Config
from memfit.planner.devices import gpu
from memfit.planner.predict import predict

# ``memfit ARGV`` in a fresh process, as the command runs, each fake step appending the pid of the process
# that ran it to $MEMFIT_TEST_PIDS. The wrapper is this script's: forked workers inherit it, and the pool
# sends it to them by name (__main__._run_one), as it sends the real one.
_RECORD_PIDS = """
import os, sys
from memfit.planner import runs

_step = runs._run_one

def _run_one(*args, **kwargs):
    with open(os.environ["MEMFIT_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return _step(*args, **kwargs)

runs._run_one = _run_one
from memfit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_fresh_memfit_plan_runs_its_steps_in_two_forked_workers_and_matches_one_process(tiny_config, tmp_path):
    """The default path: a fresh ``memfit plan`` forks its workers before any backward ran, and every fake
    step runs in one of them (two distinct pids, neither the command's); the JSON document equals a plan
    run step by step in one process (a GPU target: its time model is a formula, not timed here)."""
    cfg, pids = tiny_config(tmp_path), tmp_path / "pids"
    args = ["plan", str(cfg), "--gpu", "4090", "--png", str(tmp_path / "chart.png")]
    env = {**os.environ, "MEMFIT_PLAN_WORKERS": "2", "MEMFIT_TEST_PIDS": str(pids), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _RECORD_PIDS, *args, "--json", str(tmp_path / "pool.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    ran = [int(line) for line in pids.read_text().split()]
    steps = int(re.search(r"\((\d+) fake steps\)", out).group(1))
    assert len(ran) == steps > 2
    assert len(set(ran)) == 2 and proc.pid not in ran, (set(ran), proc.pid)  # the pool ran them, both workers

    with contextlib.redirect_stdout(io.StringIO()):  # this process, MEMFIT_PLAN_WORKERS=1 (conftest.py)
        assert main([*args, "--json", str(tmp_path / "serial.json")]) == 0
    pooled, serial = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("pool", "serial"))
    assert pooled == serial and len(serial["plans"]) > 10


def test_after_a_backward_here_the_runs_fall_back_to_this_process_and_survive_a_second_call(
        tiny_config, tmp_path, monkeypatch):
    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "1")
    serial = predict(cfg, device=gpu("H100"), verify=False)
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "2")
    # This process has run fake backward passes by now: forked workers cannot, and the runs fall back here.
    again = predict(cfg, device=gpu("H100"), verify=False)
    assert [(r.plan, r.peak_bytes) for r in again.results] == [(r.plan, r.peak_bytes) for r in serial.results]
    assert len(serial.results) > 1


def _blocks_in_one_worker(step, flag, parent):
    def run_one(*args, **kwargs):
        if os.getpid() != parent:
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL))  # the first worker to get here stops for good
            except FileExistsError:
                pass
            else:
                import threading

                lock = threading.Lock()
                lock.acquire()
                lock.acquire()
        return step(*args, **kwargs)

    run_one.__module__, run_one.__qualname__ = step.__module__, step.__qualname__  # sent by name, as the real one
    return run_one


def test_a_stuck_worker_is_stopped_and_its_steps_run_here(tiny_config, tmp_path, monkeypatch, capfd):
    """A fake-step worker that stops running (a lock its parent's thread held at the fork, say) is stopped after
    STUCK_S seconds without CPU; the prediction finishes here, equal to one run here from the start."""
    from memfit.planner import pool, runs, stuck

    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "1")
    serial = predict(cfg, device=gpu("H100"), verify=False)
    monkeypatch.setattr(stuck, "STUCK_S", 1.0)
    monkeypatch.setattr(pool, "POLL_S", 0.1)
    monkeypatch.setattr(runs, "_run_one", _blocks_in_one_worker(runs._run_one, str(tmp_path / "flag"), os.getpid()))
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "2")
    again = predict(cfg, device=gpu("H100"), verify=False)
    assert [(r.plan, r.peak_bytes) for r in again.results] == [(r.plan, r.peak_bytes) for r in serial.results]
    err = capfd.readouterr().err
    assert (tmp_path / "flag").exists() and "used no CPU for 1 s and was stopped" in err, err[-2000:]


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_worker_count_is_at_least_one(workers, monkeypatch):
    from memfit.planner.runs import workers as count

    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", workers)
    assert count() == 1


def test_steps_that_differ_only_in_wording_run_once(tiny_config, tmp_path):
    """fp16 is measured as bf16, FSDP's defaults may be written out or not, a missing strategy is None, and a
    forward/backward run overrides accumulation: such configs run one fake step, so the recommended plan's
    verification reuses the configured plan's step when they are the same step."""
    from memfit.planner.runs import _canonical
    from memfit.planner.space import ModelFacts, Plan

    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    facts = ModelFacts((), (), (), False)
    configured = {**cfg, "strategy": dict(type="FSDPStrategy"),
                  "optim_wrapper": {**cfg["optim_wrapper"], "type": "AmpOptimWrapper", "dtype": "float16"}}
    bf16 = Plan("bf16", sharding="fsdp", micro_batch=1).apply(cfg, facts)
    assert _canonical(configured, True, 2) == _canonical(bf16, True, 2)
    assert _canonical(configured, False, 2) == _canonical({**bf16, "optim_wrapper": {
        **bf16["optim_wrapper"], "accumulative_counts": 4}}, False, 1)
    for other in (Plan("fp32", sharding="fsdp", micro_batch=1), Plan("bf16", sharding="zero2", micro_batch=1),
                  Plan("bf16", "blocks", "fsdp", micro_batch=1)):
        assert _canonical(configured, True, 2) != _canonical(other.apply(cfg, facts), True, 2), other.name
    offload = {**configured, "strategy": dict(type="FSDPStrategy", cpu_offload=True)}
    assert _canonical(offload, True, 2) == _canonical(configured, True, 2)  # a no-op on CPU tensors
    assert _canonical(configured, True, 2) != _canonical(configured, True, 1)
    # A config without a strategy key runs what strategy=None runs (a configured plan beside the reference).
    plain = {k: v for k, v in cfg.items() if k != "strategy"}
    assert _canonical(plain, True, 1) == _canonical({**plain, "strategy": None}, True, 1)
    assert _canonical(configured, True, 2) != _canonical(configured, False, 2)
