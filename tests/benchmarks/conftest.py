"""Tests of the scripts in benchmarks/: each loaded as the module it is when run."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/name.py as module ``name`` (loaded once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def bench_script() -> Callable[[str], ModuleType]:
    """``bench_script('name')``: benchmarks/name.py as module ``name`` (loaded once)."""
    return load_script
