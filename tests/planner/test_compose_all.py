"""A prediction's rows composed in forked processes equal those composed here one by one, and a process that dies
leaves its rows to this one."""

import os

import pytest

from memfit.config import Config
from memfit.planner import compose_all, predict
from memfit.planner.devices import gpu


def _rows(prediction) -> list[tuple]:
    return [(r.plan, r.peak_bytes, r.allocated, r.reserved, r.seconds, r.fits) for r in prediction.results]


@pytest.fixture(scope="module")
def planned(tiny_config, tmp_path_factory):
    """The tiny config at 2 ranks (ZeRO-2 and FSDP rows, which run their sharding's step in the simulated allocator)
    on a 4090, composed here one by one."""
    cfg = Config.fromfile(str(tiny_config(tmp_path_factory.mktemp("tiny")))).to_dict()
    return cfg, predict.predict(cfg, device=gpu("4090"), world_size=2, verify=False)


def test_rows_composed_in_two_processes_equal_those_composed_in_one(planned, monkeypatch, tmp_path):
    cfg, serial = planned
    pids = tmp_path / "pids"
    row = compose_all._row

    def logged(compose, plan):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return row(compose, plan)

    monkeypatch.setattr(compose_all, "_row", logged)
    monkeypatch.setattr(predict, "workers", lambda: 2)  # the fake steps still run here (MEMFIT_PLAN_WORKERS=1)
    forked = predict.predict(cfg, device=gpu("4090"), world_size=2, verify=False)
    assert _rows(forked) == _rows(serial)
    assert any(r.plan.sharding == "fsdp" for r in serial.results) and len(serial.results) > 20
    assert len(set(pids.read_text().split())) == 2  # both processes composed rows


def test_rows_of_a_process_that_died_are_composed_here(planned, monkeypatch):
    cfg, serial = planned

    def dies(conn, compose, groups, counter):
        next(compose_all._taken(counter, len(groups)))  # takes the costliest group, then is killed
        os._exit(1)

    monkeypatch.setattr(compose_all, "_serve", dies)
    monkeypatch.setattr(predict, "workers", lambda: 2)
    assert _rows(predict.predict(cfg, device=gpu("4090"), world_size=2, verify=False)) == _rows(serial)


def test_groups_keep_rows_of_one_activations_together_costliest_first():
    from memfit.planner.space import Plan

    plans = [Plan("bf16", "none", "none", "none", False, 4, 1), Plan("bf16", "blocks", "fsdp", "none", False, 4, 1),
             Plan("bf16", "blocks", "none", "none", False, 4, 1), Plan("fp32", "none", "none", "none", False, 4, 1)]
    groups = compose_all._groups(plans)
    assert [[i for i, _ in g] for g in groups] == [[1, 2], [0], [3]]
