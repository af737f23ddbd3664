"""Noticing a forked planner process that holds work but has stopped running: blocked for good on a lock or
a thread its parent held when it was forked (a fork copies only the forking thread). Such a process uses no CPU,
while a process doing a fake step or composing rows uses it all the time; waiting on it would wait forever. Its
Python stack is written to standard error (for a bug report) and it is killed; the caller does its work itself.
Written here because neither ``multiprocessing`` nor ``concurrent.futures`` notices a child that hangs."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

STUCK_S = 60.0  # no CPU used for this long while holding work: stuck (a busy one uses CPU every second)
POLL_S = 2.0  # how often a waiting parent looks


def cpu_seconds(pid: int) -> float | None:
    """The CPU time ``pid`` has used (user and system), or None where /proc cannot say (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def dump_stack_on_request() -> None:
    """In a forked process: write every thread's Python stack to standard error on SIGUSR2 (:func:`kill_stuck`; not
    SIGUSR1, which schedulers send before preempting a job and :class:`~memfit.hooks.PreemptionHook` handles)."""
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)


class Watch:
    """The CPU time of processes holding work, since each took it; :meth:`stuck` says which have used none for
    :data:`STUCK_S` seconds."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float | None, float]] = {}

    def started(self, pid: int) -> None:
        self.seen[pid] = (cpu_seconds(pid), time.monotonic())

    def stuck(self, pid: int) -> bool:
        cpu, now = cpu_seconds(pid), time.monotonic()
        last, since = self.seen.setdefault(pid, (cpu, now))
        if cpu is None or cpu != last:
            self.seen[pid] = (cpu, now)
            return False
        return now - since >= STUCK_S


def kill_stuck(pid: int, what: str) -> str:
    """Ask the stuck process ``pid`` for its stack (:func:`dump_stack_on_request`), kill it and say so in one line."""
    for sig, pause in ((getattr(signal, "SIGUSR2", None), 0.5), (signal.SIGKILL, 0.0)):
        if sig is None:
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        time.sleep(pause)
    return (f"memfit plan: a {what} (pid {pid}) used no CPU for {STUCK_S:.0f} s and was stopped (its stack is above: "
            f"please report it); its work runs in this process")


def wait_answer(conn: Connection, pid: int, alive: Callable[[], bool], what: str) -> bool:
    """Wait until ``conn`` has something to read (True) or the process ``pid`` ended or is stuck (False; a stuck
    one is killed and reported on standard error)."""
    watch = Watch()
    watch.started(pid)
    while not conn.poll(POLL_S):
        if not alive():
            return conn.poll()
        if watch.stuck(pid):
            print(kill_stuck(pid, what), file=sys.stderr, flush=True)
            return False
    return True
