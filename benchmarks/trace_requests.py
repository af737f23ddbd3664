"""The planner's fake step of a traced H100 case against its allocator trace, request by request.

    python benchmarks/trace_requests.py "vit-l bf16 ac:blocks mb64x1" [--over 1] [--regions 20]

Runs the case's fake step for an H100 as ``memfit plan --as-is`` does (its config on the target, one step, then the
second replayed) and sets the second step's allocations and frees over ``--over`` MiB beside the trace's second step
(tests/fixtures/allocator/h100_torch2.11_large_models.json.gz or ..._dino.json.gz; cases of
benchmarks/gpu_calibration.py): the share of them that align in order, the block sizes one side allocates more
often, and the first regions where they differ, with the trace's requests just before. A CUDA kernel's temporary the
fake step lacks, or an allocation order it gets wrong, shows here first (docs/planner_accuracy.md). CPU only; a few
seconds to a minute a case.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "allocator"
MiB = 2**20


def trace_step(case: dict) -> list[tuple[str, int]]:
    """The trace's last step as ``('+', bytes)`` allocations and ``('-', bytes)`` completed frees, in order."""
    ends = [s["trace_len"] for s in case["steps"]]
    live: dict[int, int] = {}
    out = []
    for action, addr, size, _stream in case["trace"][ends[-2]:ends[-1]]:
        if action == "alloc":
            live[addr] = size
            out.append(("+", size))
        elif action == "free_completed" and addr in live:
            out.append(("-", live.pop(addr)))
    return out


def replayed_step(trace: list[tuple[Any, int | None]]) -> list[tuple[str, int]]:
    """A simulated allocator's second step (its calls from the first ``('again', ...)`` key on), as
    :func:`trace_step`."""
    first = next(i for i, (key, _) in enumerate(trace) if isinstance(key, tuple) and key[:1] == ("again",))
    live: dict[Any, int] = {}
    out = []
    for key, nbytes in trace[first:]:
        if nbytes is not None:
            live[key] = nbytes
            out.append(("+", nbytes))
        elif key in live:
            out.append(("-", live.pop(key)))
    return out


def compare(real: list[tuple[str, int]], fake: list[tuple[str, int]], over: int = MiB, regions: int = 20
            ) -> dict[str, Any]:
    """The two steps' calls over ``over`` bytes: ``ratio`` (difflib's, of those aligned in order), ``more`` (size ->
    how many more allocations the fake step makes of it; negative: fewer), ``regions`` (the first differing
    stretches: the trace's calls before, the trace's and the fake step's there)."""
    a = [c for c in real if c[1] > over]
    b = [c for c in fake if c[1] > over]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    allocs = Counter(n for s, n in a if s == "+"), Counter(n for s, n in b if s == "+")
    more = {n: allocs[1][n] - allocs[0][n] for n in set(allocs[0]) | set(allocs[1]) if allocs[0][n] != allocs[1][n]}
    found = [(a[max(0, i1 - 6):i1], a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
             if tag != "equal"]
    return {"ratio": matcher.ratio(), "real": len(a), "fake": len(b), "more": more, "regions": found[:regions]}


def _case(name: str) -> dict:
    for path in sorted(FIXTURES.glob("h100_torch2.11_*.json.gz")):
        with gzip.open(path, "rt") as f:
            for case in json.load(f)["cases"]:
                if case.get("name") == name:
                    return case
    raise SystemExit(f"no traced case named {name!r} in {FIXTURES}: see the fixtures' README")


def fake_step_calls(name: str) -> list[tuple[Any, int | None]]:
    """The simulated allocator's calls of case ``name``'s fake step for an H100 (one step, then its replay)."""
    from unittest import mock

    import memfit.planner.fake as fake
    from memfit.measure import CachingAllocatorModel
    from memfit.planner.devices import GPUS
    from memfit.planner.predict import on_target

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_calibration as cal

    made: list[CachingAllocatorModel] = []

    class Kept(CachingAllocatorModel):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    _, spec, options, words = next(c for c in cal.CASES if c[0] == name)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = cal._config(spec, options, cal._data(tmp))
        plan, facts = cal._plan(cfg, words, cuda=True)
        cfg = on_target(plan.apply(cfg, facts), GPUS["H100"])
        with mock.patch.object(fake, "CachingAllocatorModel", Kept), fake.fake_process_group(1):
            fake.measure_step(cfg, full=True, steps=1, cuda=True)
    return made[0].trace


def _mib(calls: list[tuple[str, int]]) -> str:
    return " ".join(f"{s}{n / MiB:.1f}" for s, n in calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="a traced case of benchmarks/gpu_calibration.py, e.g. 'vit-l bf16 mb64x1'")
    parser.add_argument("--over", type=float, default=1.0, help="only blocks over this many MiB (default 1)")
    parser.add_argument("--regions", type=int, default=20, help="differing regions to print (default 20)")
    args = parser.parse_args()
    out = compare(trace_step(_case(args.case)), replayed_step(fake_step_calls(args.case)), int(args.over * MiB),
                  args.regions)
    print(f"{args.case}: {out['real']} calls in the trace's second step, {out['fake']} in the fake step's; "
          f"{out['ratio']:.3f} aligned")
    print("| block MiB | allocations the fake step makes more (fewer: negative) |\n|---|---|")
    for n, d in sorted(out["more"].items(), key=lambda kv: -kv[0]):
        print(f"| {n / MiB:.2f} | {d:+d} |")
    for before, real, fake in out["regions"]:
        print(f"after {_mib(before)}:  trace {_mib(real) or '-'}  |  fake {_mib(fake) or '-'}")


if __name__ == "__main__":
    main()
