"""The planner's worker pool: a step goes to the worker whose caches are warm for it, results and errors
come back, and a worker that dies is reported in one line."""

from __future__ import annotations

import os
import time

import pytest

from memfit.planner.pool import Job, Pool, WorkerDied


def _init() -> None:
    pass


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _fail() -> None:
    raise ValueError("bad plan")


def _die() -> None:
    os._exit(3)


def _run(pool: Pool, jobs: dict) -> dict:
    out: dict = {}

    def done(key, ok, value):
        out[key] = value if ok else ("failed", value)
        return True

    pool.run(jobs, done)
    return out


def test_steps_of_a_kind_stay_with_the_worker_warm_for_it_and_a_later_one_follows():
    """Three FSDP-like steps (cold cost 2.5) beside eight plain ones on two workers: one worker takes every
    FSDP step while the other has plain work, and a step submitted later goes to the warm worker."""
    pool = Pool(2, _init)
    try:
        jobs = {("fsdp", i): Job(_pid_after, (0.1,), 2.0, {"dtensor": 2.5}) for i in range(3)}
        jobs.update({("plain", i): Job(_pid_after, (0.05,), 1.0) for i in range(8)})
        pids = _run(pool, jobs)
        fsdp = {pids[("fsdp", i)] for i in range(3)}
        assert len(fsdp) == 1
        assert len(set(pids.values())) == 2  # both workers ran steps
        later = _run(pool, {"verify": Job(_pid_after, (0.0,), 2.0, {"dtensor": 2.5})})
        assert later["verify"] in fsdp
    finally:
        pool.close()
    assert not any(w.process.is_alive() for w in pool.workers)


def test_a_later_step_finds_the_warm_worker_whichever_it_is():
    """The second worker warmed the FSDP kind (the first took a longer plain step): with both free, a later
    FSDP step goes to the second, not to the first one free in the list."""
    pool = Pool(2, _init)
    try:
        pids = _run(pool, {"long": Job(_pid_after, (0.05,), 3.0),
                           "fsdp": Job(_pid_after, (0.05,), 2.0, {"dtensor": 2.5})})
        assert pids["long"] != pids["fsdp"]
        later = _run(pool, {"verify": Job(_pid_after, (0.0,), 2.0, {"dtensor": 2.5})})
        assert later["verify"] == pids["fsdp"]
    finally:
        pool.close()


def test_a_steps_exception_comes_back_and_a_dead_worker_is_one_line():
    pool = Pool(2, _init)
    try:
        out = _run(pool, {"bad": Job(_fail, (), 1.0), "good": Job(_pid_after, (0.0,), 1.0)})
        assert out["bad"][0] == "failed" and isinstance(out["bad"][1], ValueError)
        assert isinstance(out["good"], int)
        with pytest.raises(WorkerDied, match=r"planner worker process \(pid \d+\) ended .*exit code 3"):
            _run(pool, {"dies": Job(_die, (), 1.0)})
    finally:
        pool.close()


def test_ctrl_c_is_the_parents_a_worker_ignores_it_and_goes_on():
    """Ctrl-C reaches every process of the terminal's group: the workers leave it to the parent, which stops and
    closes the pool (a worker printed its own KeyboardInterrupt traceback before)."""
    import signal

    pool = Pool(1, _init)
    try:
        time.sleep(0.5)  # the worker waits for a job
        os.kill(pool.workers[0].process.pid, signal.SIGINT)
        time.sleep(0.5)
        out = _run(pool, {"after": Job(_pid_after, (0.0,), 1.0)})
        assert out["after"] == pool.workers[0].process.pid
    finally:
        pool.close()


def _blocked() -> None:
    import threading

    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # as a fork's child waits for a lock a thread of its parent held: forever, using no CPU


def _spin(seconds: float) -> int:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return os.getpid()


def test_a_worker_that_stops_running_is_stopped_with_its_stack_and_a_busy_one_is_not(monkeypatch, capfd):
    """A worker holding a step that uses no CPU for STUCK_S seconds is stuck (a fork can inherit a lock its parent's
    other thread held): the pool says so in one line instead of waiting forever, after the worker wrote its Python
    stack; a worker computing for longer than that is left to finish."""
    from memfit.planner import pool as pool_module
    from memfit.planner import stuck

    monkeypatch.setattr(stuck, "STUCK_S", 1.0)
    monkeypatch.setattr(pool_module, "POLL_S", 0.1)
    pool = Pool(2, _init)
    try:
        out = _run(pool, {"busy": Job(_spin, (2.0,), 1.0)})
        assert out["busy"] in {w.process.pid for w in pool.workers}
        start = time.monotonic()
        with pytest.raises(pool_module.WorkerStuck, match=r"^memfit plan: a fake-step worker process \(pid \d+\) "
                                                          r"used no CPU for 1 s and was stopped"):
            _run(pool, {"blocked": Job(_blocked, (), 1.0)})
        assert time.monotonic() - start < 45  # well before the 60 s a real worker is given
        assert sum(w.process.is_alive() for w in pool.workers) == 1  # the stuck one was killed
        assert "in _blocked" in capfd.readouterr().err  # its stack, from faulthandler
    finally:
        pool.close()
