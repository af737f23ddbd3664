"""CocoMetric takes MMDetection 3's arguments: local ``backend_args``/``file_client_args`` (what its dataset configs
pass down), and ``sort_categories``/``use_mp_eval``, which change nothing here and say so once."""

from __future__ import annotations

import pytest

from memfit import errors
from memfit.errors import ConfigError
from memfit.evaluator.coco_metric import CocoMetric


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(errors, "_WARNED", set())


def _warnings(caplog) -> list[str]:
    records = {id(r): r for r in caplog.records}.values()
    return [r.getMessage() for r in records if r.name == "memfit" and "has no effect" in r.getMessage()]


def test_local_backend_args_are_accepted_silently(caplog):
    CocoMetric(metric="bbox", backend_args=None)
    CocoMetric(metric="bbox", file_client_args=dict(backend="local"))
    assert _warnings(caplog) == []


def test_remote_backend_args_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^CocoMetric\.backend_args: backend_args=\{'backend': 'petrel'\}: memfit "
                                          r"reads local files only: set backend_args=None$"):
        CocoMetric(metric="bbox", backend_args=dict(backend="petrel"))
    with pytest.raises(ConfigError, match=r"^CocoMetric\.file_client_args: file_client_args=\{'backend': 's3'\}: "
                                          r"memfit reads local files only: set file_client_args=None$"):
        CocoMetric(metric="bbox", file_client_args=dict(backend="s3"))


@pytest.mark.parametrize(("kwargs", "warned"), [
    (dict(sort_categories=True), "CocoMetric(sort_categories=True) has no effect in memfit: labels map to the "
                                 "annotation file's categories by name"),
    (dict(use_mp_eval=True), "CocoMetric(use_mp_eval=True) has no effect in memfit: COCOeval runs in this process"),
])
def test_switches_that_change_nothing_here_warn_once(caplog, kwargs, warned):
    CocoMetric(metric="bbox", **kwargs)
    CocoMetric(metric="bbox", **kwargs)
    found = _warnings(caplog)
    assert len(found) == 1 and found[0].startswith(warned), found
