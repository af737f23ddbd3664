"""A prediction's rows composed in forked processes equal those composed here one by one, and a process that dies
leaves its rows to this one."""

import os
import time

import pytest
import torch

from memfit.config import Config
from memfit.planner import compose_all, predict
from memfit.planner.devices import gpu, this_cpu
from memfit.planner.results import AUTO_FIT_MARGIN


def _rows(prediction) -> list[tuple]:
    return [(r.plan, r.peak_bytes, r.allocated, r.reserved, r.seconds, r.fits) for r in prediction.results]


@pytest.fixture(scope="module", params=["4090", "cpu"])
def planned(request, tiny_config, tmp_path_factory):
    """The tiny config at 2 ranks, composed here one by one: for a 4090 (ZeRO-2 and FSDP rows run their sharding's
    step in the simulated allocator), and for this CPU in a budget where a plan fits with its blocks checkpointed
    but not without (the planner then searches the fewest first blocks, ``ac:firstN``, that fit). Returns
    ``(predict's arguments, its prediction)``."""
    cfg = Config.fromfile(str(tiny_config(tmp_path_factory.mktemp("tiny")))).to_dict()
    args = dict(device=gpu("4090") if request.param == "4090" else this_cpu(), world_size=2, verify=False)
    if request.param == "cpu":
        rows = {r.plan.name: r.peak_bytes for r in predict.predict(cfg, **args).results}
        none, blocks = rows["fp32 fsdp mb1x1"], rows["fp32 ac:blocks fsdp mb1x1"]
        assert blocks < none
        args["budget"] = int((none + blocks) / 2 / (1 - AUTO_FIT_MARGIN))
    return cfg, args, predict.predict(cfg, **args)


def test_rows_composed_in_two_processes_equal_those_composed_in_one(planned, monkeypatch, tmp_path):
    """... and the forked process runs on one thread: a fake step it had to run itself would otherwise wait forever
    for the parent's OpenMP threads, which are not in the fork (Swin-L's composition hung so)."""
    cfg, args, serial = planned
    pids = tmp_path / "pids"
    row = compose_all._row

    parent, waited = os.getpid(), []

    def logged(compose, plan):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}:{torch.get_num_threads()}\n")
        if os.getpid() == parent and not waited:  # the forked process takes the next group while this one waits
            waited.append(True)  # (a CPU target's rows compose faster than a fork starts: this process took them all)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and all(line.startswith(f"{parent}:")
                                                      for line in pids.read_text().split()):
                time.sleep(0.01)
        return row(compose, plan)

    monkeypatch.setattr(compose_all, "_row", logged)
    monkeypatch.setattr(predict, "workers", lambda: 2)  # the fake steps still run here (MEMFIT_PLAN_WORKERS=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        forked = predict.predict(cfg, **args)
    finally:
        torch.set_num_threads(threads)
    assert _rows(forked) == _rows(serial)
    assert any(r.plan.sharding == "fsdp" for r in serial.results) and len(serial.results) > 20
    seen = dict(line.split(":") for line in pids.read_text().split())
    assert len(seen) == 2  # both processes composed rows
    assert seen == {str(os.getpid()): "2", **{pid: "1" for pid in seen if pid != str(os.getpid())}}
    if "budget" in args:
        assert any(r.plan.activation_checkpointing == "first1" for r in serial.results)


def test_rows_of_a_process_that_died_are_composed_here(planned, monkeypatch):
    cfg, args, serial = planned

    def dies(conn, runs, work, fn, counter):
        next(compose_all._taken(counter, len(work)))  # takes the costliest group, then is killed
        os._exit(1)

    monkeypatch.setattr(compose_all, "_serve", dies)
    monkeypatch.setattr(predict, "workers", lambda: 2)
    assert _rows(predict.predict(cfg, **args)) == _rows(serial)


def test_rows_of_a_process_that_is_stuck_are_composed_here(planned, monkeypatch, capfd):
    """A forked process that takes a group and then stops running (no CPU for STUCK_S seconds) is stopped, and its
    rows are composed here: the same rows, one line on standard error."""
    from memfit.planner import stuck

    cfg, args, serial = planned

    def stops(conn, runs, work, fn, counter):
        import threading

        next(compose_all._taken(counter, len(work)))
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()

    monkeypatch.setattr(compose_all, "_serve", stops)
    monkeypatch.setattr(predict, "workers", lambda: 2)
    monkeypatch.setattr(stuck, "STUCK_S", 1.0)
    monkeypatch.setattr(stuck, "POLL_S", 0.1)
    assert _rows(predict.predict(cfg, **args)) == _rows(serial)
    assert "row-composing process (pid" in capfd.readouterr().err


def test_groups_keep_rows_of_one_activations_together_costliest_first():
    from memfit.planner.space import Plan

    plans = [Plan("bf16", "none", "none", "none", False, 4, 1), Plan("bf16", "blocks", "fsdp", "none", False, 4, 1),
             Plan("bf16", "blocks", "none", "none", False, 4, 1), Plan("fp32", "none", "none", "none", False, 4, 1)]
    groups = compose_all.groups(plans)
    assert [[i for i, _ in g] for g in groups] == [[1, 2], [0], [3]]


def test_a_row_that_fails_in_a_forked_process_is_left_out_with_its_reason(planned, monkeypatch):
    """A composition's StepFailed comes back from the process that raised it (pickled) and the plan is left out
    with its reason, as when composed here."""
    from memfit.planner.composer import Composer

    cfg, args, _ = planned
    call = Composer.__call__

    def fails_for_fsdp(self, plan):
        if plan.sharding == "fsdp" and not self.runs.collecting:  # composed, not while the steps are collected
            raise predict.StepFailed("RuntimeError: not this one")
        return call(self, plan)

    monkeypatch.setattr(Composer, "__call__", fails_for_fsdp)
    serial = predict.predict(cfg, **args)
    monkeypatch.setattr(predict, "workers", lambda: 2)
    forked = predict.predict(cfg, **args)
    assert _rows(forked) == _rows(serial) and not any(r.plan.sharding == "fsdp" and r.source == "composed"
                                                      for r in forked.results)
    assert forked.notes == serial.notes and any("not this one" in n for n in forked.notes)
