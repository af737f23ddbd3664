"""Where the Runner's time goes against the plain loop on one GPU: the plain loop, the Runner, and the Runner
with one of its parts switched off (the invalid-loss check, the batch taken ahead on a side stream), paired
round by round in one process, then 5 steps of the plain loop and of the Runner under torch.profiler (the top
CUDA kernels and operator counts side by side).

    PYTHONPATH=. python3 benchmarks/runner_gap.py --out DIR      # ResNet-50 and ViT-B, about 90 s on an H100
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput_cases import MODELS, SMOKE_MODELS, Case, plain_path, runner_cfg  # noqa: E402
from throughput_paths import RunnerPath, backend_flags  # noqa: E402
from timing import profile_block  # noqa: E402


def _no_check(cfg: dict) -> dict:
    return {**cfg, "default_hooks": {**cfg["default_hooks"], "check_invalid_loss": None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="on the CPU, tiny models, fp32: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.block, args.warmup = 2, 2, 2
    elif not torch.cuda.is_available():
        print("runner_gap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import memfit.loops
    from memfit.data.prefetch import prefetch

    device, flags = torch.device("cpu" if args.smoke else "cuda"), backend_flags()
    name = "cpu" if args.smoke else torch.cuda.get_device_name()
    results: dict = {"device": name, "torch": torch.__version__, "cases": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for key in ("resnet50", "vit_b16"):
        model = (SMOKE_MODELS if args.smoke else MODELS)[key]
        case = Case(f"{key} bf16", key, "fp32" if args.smoke else "bf16", "memory", [], 0)
        cfg = runner_cfg(model, case, 6, not args.smoke)
        paths = {"plain": plain_path(model, case, 6, device, flags), "runner": RunnerPath("runner", cfg, device, flags),
                 "runner, no invalid-loss check": RunnerPath("nocheck", _no_check(cfg), device, flags),
                 "runner, no batch ahead": RunnerPath("noahead", cfg, device, flags)}
        for name, path in paths.items():  # the no-ahead path's loop is built while prefetch is patched
            memfit.loops.prefetch = functools.partial(prefetch, ahead=False) if "ahead" in name else prefetch
            path.block(args.warmup)
        memfit.loops.prefetch = prefetch
        rates: dict[str, list[float]] = {n: [] for n in paths}
        for _ in range(args.rounds):
            for name, path in paths.items():
                rates[name].append(path.images_per_iter * args.block / path.block(args.block))
        med = {n: statistics.median(r) for n, r in rates.items()}
        print(f"\n## {model.label}, bf16, {results['device']}, torch {torch.__version__}")
        for n, m in med.items():
            print(f"{n:34s} {m:8.0f} img/s  {m / med['plain']:.3f}x plain   rounds {[round(r) for r in rates[n]]}")
        prof = {}
        for name in ("plain", "runner"):
            prof[name] = profile_block(paths[name].block, 5)
            print(f"\n{name}: {prof[name]['cuda_ms_per_step']:.2f} ms of kernels a step, "
                  f"{prof[name]['kernels_per_step']:.0f} kernels a step")
            for k, ms, c in prof[name]["top"]:
                print(f"  {ms:8.3f} ms  x{c:<5d} {k}")
        a, b = prof["plain"]["cpu_ops_per_step"], prof["runner"]["cpu_ops_per_step"]
        extra = sorted(((k, b.get(k, 0) - a.get(k, 0)) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)),
                       key=lambda kv: -abs(kv[1]))
        print("\noperators per step, runner minus plain:", extra[:25])
        results["cases"][key] = {"img_s": rates, "profile": prof, "op_diff": extra[:60]}
        (args.out / "runner_gap.json").write_text(json.dumps(results, indent=1))
        for path in paths.values():
            path.close()
        torch.cuda.empty_cache()
    (args.out / "runner_gap.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
