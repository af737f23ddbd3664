"""The planner's fake step of a traced H100 case against its allocator trace, request by request.

    python benchmarks/trace_requests.py "vit-l bf16 ac:blocks mb64x1" [--over 1] [--regions 20] [--ops]
    python benchmarks/trace_requests.py resnet50 --ops

Runs the case's fake step for an H100 as ``memfit plan --as-is`` does (its config on the target, one step, then the
second replayed) and sets the second step's allocations and frees over ``--over`` MiB beside the trace's last step
(any case of tests/fixtures/allocator/h100_torch2.11_*.json.gz: benchmarks/gpu_calibration.py's, and the six memfit
runs of ..._cuda13.json.gz by their names, ``vit_s16``, ``swin_t``, ``resnet50``, ...): the share of them that align
in order, the block sizes one side allocates more often, and the first regions where they differ, with the trace's
requests just before. ``--ops`` names the fake step's operator before each region and counts the blocks the trace
allocates and frees at once (a kernel's workspace) after each operator: a CUDA kernel's temporary the fake step
lacks, or an allocation order it gets wrong, shows here first (docs/planner_accuracy.md). CPU only; a few seconds to
a minute a case.
"""

from __future__ import annotations

import argparse
import contextlib
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


def replayed_step(trace: list[tuple[Any, int | None]], origins: list[int] | None = None,
                  labels: dict[int, str] | None = None) -> list[tuple[str, int]]:
    """A simulated allocator's second step (its calls from the first ``('again', ...)`` key on), as
    :func:`trace_step`. With ``origins`` (the first step's call each replayed one repeats:
    :meth:`CachingAllocatorModel.replayed`) and ``labels`` (call index -> the operator that made it), each call comes
    with its operator as a third item."""
    first = next(i for i, (key, _) in enumerate(trace) if isinstance(key, tuple) and key[:1] == ("again",))
    live: dict[Any, int] = {}
    out: list = []
    for j, (key, nbytes) in enumerate(trace[first:]):
        label = (labels or {}).get(origins[j], "?") if origins is not None else None
        if nbytes is not None:
            live[key] = nbytes
            out.append(("+", nbytes) if label is None else ("+", nbytes, label))
        elif key in live:
            out.append(("-", live.pop(key)) if label is None else ("-", live.pop(key), label))
    return out


def workspaces(real: list[tuple[str, int]], fake: list[tuple], over: int = MiB) -> dict[str, list[int]]:
    """Blocks over ``over`` bytes the trace allocates and frees at once (a kernel's workspace) where the fake step
    has none, by the fake step's operator before them (``fake``: :func:`replayed_step`'s calls with operators)."""
    a = [c for c in real if c[1] > over]
    b = [c for c in fake if c[1] > over]
    out: dict[str, list[int]] = {}
    matcher = difflib.SequenceMatcher(a=a, b=[c[:2] for c in b], autojunk=False)
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        k = i1
        while tag != "equal" and k < i2:
            if a[k][0] == "+" and k + 1 < i2 and a[k + 1] == ("-", a[k][1]):
                out.setdefault(b[j1 - 1][2] if j1 else "(the step's start)", []).append(a[k][1])
                k += 1
            k += 1
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


def _config(name: str, tmp: str) -> dict:
    """The case's config as its run trained it, on the target as ``memfit plan --as-is`` sets it (its data, where
    it has files, written in ``tmp``)."""
    from memfit.planner.devices import GPUS
    from memfit.planner.predict import on_target

    sys.path.insert(0, str(Path(__file__).parent))
    case = _case(name)
    if "runner_cfg" in case:  # one of the six memfit runs (h100_torch2.11_cuda13.json.gz)
        from throughput_paths import RandomImages

        cfg = dict(case["runner_cfg"])
        loader = dict(cfg["train_dataloader"])
        loader["dataset"] = RandomImages(**{k: v for k, v in loader["dataset"].items() if k != "type"})
        return on_target({**cfg, "train_dataloader": loader}, GPUS["H100"])
    import gpu_calibration as cal

    _, spec, options, words = next(c for c in cal.CASES if c[0] == name)
    cfg = cal._config(spec, options, cal._data(tmp))
    plan, facts = cal._plan(cfg, words, cuda=True)
    return on_target(plan.apply(cfg, facts), GPUS["H100"])


def _label(func: Any, args: tuple) -> str:
    import torch

    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
    return f"{func.__name__}{shapes}"


def fake_step_calls(name: str, ops: bool = False) -> tuple[list[tuple[Any, int | None]], list[int] | None,
                                                           dict[int, str] | None]:
    """The simulated allocator's calls of case ``name``'s fake step for an H100 (one step, then its replay); with
    ``ops``, also the first step's calls the replay repeats (:meth:`CachingAllocatorModel.replayed`) and each
    first-step call's operator (call index -> name and input shapes)."""
    from unittest import mock

    import memfit.planner.fake as fake
    from memfit.measure import CachingAllocatorModel
    from memfit.measure.live_storages import LiveStorages

    made: list[CachingAllocatorModel] = []
    starts: list[int] = []
    replayed: list[int] = []
    labels: dict[int, str] = {}

    class Kept(CachingAllocatorModel):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

        def replay(self, start: int) -> None:
            starts.append(start)
            replayed.extend(self.replayed(start))
            super().replay(start)

    dispatch = LiveStorages.__torch_dispatch__

    def labelled(self: LiveStorages, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        before = len(self.allocator.trace) if self.allocator is not None else 0
        out = dispatch(self, func, types, args, kwargs)
        if self.allocator is not None and not starts:
            for i in range(before, len(self.allocator.trace)):
                labels[i] = _label(func, args)
        return out

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(fake, "CachingAllocatorModel", Kept), \
            fake.fake_process_group(1), \
            mock.patch.object(LiveStorages, "__torch_dispatch__", labelled) if ops else contextlib.nullcontext():
        fake.measure_step(_config(name, tmp), full=True, steps=1, cuda=True)
    trace = made[0].trace
    if not ops:
        return trace, None, None
    return trace, replayed, labels


def _mib(calls: list[tuple[str, int]]) -> str:
    return " ".join(f"{s}{n / MiB:.1f}" for s, n in calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="a traced case: 'vit-l bf16 mb64x1' (gpu_calibration.py's), 'resnet50', ...")
    parser.add_argument("--over", type=float, default=1.0, help="only blocks over this many MiB (default 1)")
    parser.add_argument("--regions", type=int, default=20, help="differing regions to print (default 20)")
    parser.add_argument("--ops", action="store_true", help="name the fake step's operator before each region")
    args = parser.parse_args()
    over = int(args.over * MiB)
    trace, where, labels = fake_step_calls(args.case, ops=args.ops)
    fake = replayed_step(trace, where, labels)
    real = trace_step(_case(args.case))
    out = compare(real, [c[:2] for c in fake], over, args.regions)
    print(f"{args.case}: {out['real']} calls in the trace's last step, {out['fake']} in the fake step's; "
          f"{out['ratio']:.3f} aligned")
    print("| block MiB | allocations the fake step makes more (fewer: negative) |\n|---|---|")
    for n, d in sorted(out["more"].items(), key=lambda kv: -kv[0]):
        print(f"| {n / MiB:.2f} | {d:+d} |")
    if args.ops:
        print("| after the fake step's operator | workspaces only the trace has, MiB |\n|---|---|")
        for op, sizes in sorted(workspaces(real, fake, over).items(), key=lambda kv: -sum(kv[1])):
            print(f"| {op} | {' '.join(f'{n / MiB:.2f}' for n in sizes)} |")
    for before, real_calls, fake_calls in out["regions"]:
        print(f"after {_mib(before)}:  trace {_mib(real_calls) or '-'}  |  fake {_mib(fake_calls) or '-'}")


if __name__ == "__main__":
    main()
