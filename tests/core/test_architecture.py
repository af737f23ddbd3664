"""The package's shape: no import cycles, layers import only downwards, every module imports on its
own, files stay small. Imports are read from the source (AST), function-level ones included: a lazy
import is still a dependency."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import memfit

ROOT = Path(memfit.__file__).parent
MAX_LINES = 450

# Lower layers never import higher ones (docs/architecture.md's table). Anything not listed is the top
# layer (runner, loops, hooks, cli, ...).
LAYERS = {
    "memfit._version": 0, "memfit.errors": 0, "memfit.dist": 0, "memfit.registry": 0,
    "memfit.measure": 0,  # the measurement engine: the memory techniques may use it, it never uses them
    "memfit.checkpoint": 1, "memfit.precision": 1, "memfit.memory": 1, "memfit.model": 1, "memfit.data": 1,
    "memfit.evaluator": 1, "memfit.config": 1, "memfit.logger": 1,
    "memfit.strategies": 2, "memfit.speed": 2,
    "memfit.optim": 3,  # a wrapper used on its own makes itself a one-device strategy
    "memfit.connector": 4,
    "memfit.planner": 5,  # runs connector.setup on fake tensors; the runner's auto_fit calls it
}
TOP = 6


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _reexports(module: str) -> dict[str, str]:
    """For a package ``__init__``: the names it imports from its submodules -> those submodules."""
    path = MODULES[module]
    if path.name != "__init__.py":
        return {}
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(module + "."):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _in_type_checking(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(module: str) -> set[str]:
    """The memfit modules ``module`` imports, resolved to the module that defines each name."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("memfit")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("memfit"):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in MODULES:
                    found.add(target)
                else:
                    found.add(_reexports(base).get(alias.name, base) if base in MODULES else base)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> int:
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return TOP


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_the_imports():
    # Guards the AST reading itself: known edges, lazy and re-exported ones included.
    assert "memfit.strategies.base" in GRAPH["memfit.strategies.fsdp"]
    assert "memfit.checkpoint.dcp" in GRAPH["memfit.strategies.base"]  # a function-level import
    assert "memfit.checkpoint.io" in GRAPH["memfit.strategies.base"]  # re-exported by memfit.checkpoint


def test_no_import_cycles():
    assert _cycles() == []


def test_layers_import_only_downwards():
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                    if _layer(d) > _layer(m) and _layer(m) < TOP)
    assert upward == [], "\n".join(upward)


def test_the_planner_sits_between_the_connector_and_the_runner():
    planner_deps = {d for m, deps in GRAPH.items() if m.startswith("memfit.planner.") for d in deps}
    assert "memfit.connector" in planner_deps  # it sets plans up as the runner does
    assert "memfit.planner.autofit" in GRAPH["memfit.runner"]  # Runner.from_cfg's auto_fit
    assert _layer("memfit.connector") < _layer("memfit.planner") < _layer("memfit.runner") == TOP
    # Never the runner, nor anything else of the top layer (also caught by the test above).
    assert sorted(d for d in planner_deps if _layer(d) == TOP) == []


def test_checkpoint_formats_do_not_live_in_strategies():
    assert not [d for m, deps in GRAPH.items() if m.startswith("memfit.checkpoint") for d in deps
                if d.startswith("memfit.strategies")]


def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh module table (torch stays loaded: one process). Without
    bytecode files (PYTHONDONTWRITEBYTECODE=1) every fresh import would compile all of memfit again (most of
    the time): the process compiles each source once and executes that code object in each fresh module,
    as a .pyc would serve it."""
    code = (
        "import importlib, importlib.machinery, sys, traceback\n"
        "_compiled, _to_code = {}, importlib.machinery.SourceFileLoader.source_to_code\n"
        "def _cached(self, data, path, *args, **kwargs):\n"
        "    if (path, data) not in _compiled:\n"
        "        _compiled[path, data] = _to_code(self, data, path, *args, **kwargs)\n"
        "    return _compiled[path, data]\n"
        "importlib.machinery.SourceFileLoader.source_to_code = _cached\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for key in [k for k in sys.modules if k == 'memfit' or k.startswith('memfit.')]:\n"
        "        del sys.modules[key]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc().strip().splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    modules = sorted(m for m in MODULES if m != "memfit.__main__")  # that one runs the CLI
    # Two processes, each importing every other module: half the wall time on two cores.
    procs = [subprocess.Popen([sys.executable, "-c", "import torch\n" + code, *modules[i::2]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err[-3000:]


def test_no_file_over_the_size_limit():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
