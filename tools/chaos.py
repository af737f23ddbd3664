"""Kill training runs at random moments, resume them, and check that nothing was lost.

    python tools/chaos.py --kills 100                      # every strategy, 2 CPU ranks (gloo)
    python tools/chaos.py --kills 6 --strategies single,ddp --seed 1
    python tools/chaos.py --trials fsdp:before:5,zero1:save:6   # these trials only

Each trial draws (from ``--seed``) a strategy, a moment and an iteration: ``before`` an iteration (inside an
accumulation window when the iteration is odd), inside a checkpoint ``save`` (its files written, not yet
published), before the ``pointer`` (``last_checkpoint``) names a complete checkpoint, or inside ``eval``.
The run (tools/chaos_run.py, 1 or 2 ranks) is SIGKILLed there, every rank at once; it is resumed with
``resume=True`` until it completes, and then compared with an uninterrupted run of the same strategy: the
global loss of every iteration any of the runs trained, and the final checkpoint's weights and optimizer
state. Prints a table; the last line is ``K/N resumes with nothing lost``; exits 1 when K < N.
``--reshard`` resumes each killed 2-rank run on one rank with the same global batch (DDP, ZeRO-1, FSDP): the
same samples summed in another order, so equal within float32 rounding (without dropout, whose streams are
per rank).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from chaos_run import ACCUMULATION, ITERS, SAVE_EVERY, STRATEGIES, VAL_EVERY  # noqa: E402

from memfit.strategies import capabilities_of  # noqa: E402
from memfit.testing import DEEPSPEED_PRELOAD, launch  # noqa: E402

SCRIPT = Path(__file__).parent / "chaos_run.py"
RANKS = {"single": 1}  # every other strategy runs on 2 ranks
RESHARDABLE = ("ddp", "zero1", "fsdp")  # their checkpoints load at another world size
# Resumed at another world size the same samples are summed in another order: float32 rounding, no more.
RESHARD_TOLERANCE = 1e-5
MOMENTS = ("before", "save", "pointer", "eval")


def run(opts: dict, nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """One run in its own process group (so that a kill takes every rank and their parent with it): ranks forked
    from one parent that imported torch and memfit (``memfit.testing.launch``, torchrun's variables)."""
    Path(opts["log"]).parent.mkdir(parents=True, exist_ok=True)
    preload = DEEPSPEED_PRELOAD if opts["strategy"].startswith("deepspeed") else ("torch", "memfit.runner")
    return launch(SCRIPT, nproc, [json.dumps(opts)], out_dir=Path(opts["work_dir"]).parent / "launch",
                  timeout=timeout, preload=preload)


def losses(log: Path) -> tuple[dict[int, list[str]], int]:
    """Every iteration's recorded losses (several when an iteration was trained again) and the resumes."""
    out: dict[int, list[str]] = {}
    resumes = 0
    for line in log.read_text().splitlines() if log.exists() else []:
        key, value = line.split()
        if key == "resumed":
            resumes += 1
        else:
            out.setdefault(int(key), []).append(value)
    return out, resumes


def completed(work_dir: Path, log: Path) -> bool:
    """The run trained to the end and published its last checkpoint, whatever its exit status (DeepSpeed over
    gloo rarely aborts in its teardown, after the work is done)."""
    from memfit.checkpoint import read_latest

    latest = read_latest(work_dir)
    return latest is not None and latest.name == f"iter_{ITERS}.pth" and ITERS - 1 in losses(log)[0]


def final_state(work_dir: Path) -> dict[str, torch.Tensor]:
    """The final checkpoint's tensors (weights, and the optimizer state where it can be read in one process:
    DeepSpeed's shards are compared file by file), flattened to ``key.path -> tensor``."""
    from memfit.checkpoint import read_latest
    from memfit.checkpoint.deepspeed import is_deepspeed_checkpoint, weights_only_loads
    from memfit.checkpoint.export import read_checkpoint

    path = read_latest(work_dir)
    if path is None:
        raise RuntimeError(f"{work_dir}: no final checkpoint")
    deepspeed = is_deepspeed_checkpoint(path)
    state = read_checkpoint(path, with_optimizer=not deepspeed)
    flat: dict[str, torch.Tensor] = {}
    _flatten({k: state[k] for k in ("state_dict", "optim_wrapper") if k in state}, "", flat)
    if deepspeed:
        with weights_only_loads():
            for f in sorted(path.rglob("*optim_states.pt")):
                _flatten(torch.load(f, map_location="cpu", weights_only=True), f.name + ".", flat)
    return flat


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix.rstrip(".")] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}{i}.", out)


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """0.0 when every tensor is bit-equal, else the largest absolute difference (inf: different keys/shapes)."""
    if sorted(ref) != sorted(got):
        return float("inf")
    worst = 0.0
    for k, a in ref.items():
        b = got[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not torch.equal(a, b):
            worst = max(worst, float((a.double() - b.double()).abs().max()))
    return worst


def trial(root: Path, strategy: str, moment: str, k: int, amp: bool, ref: dict, reshard: bool = False) -> dict:
    """One killed run, resumed until it completes; what it lost against the reference ``ref``. ``reshard``: the
    resume runs on one rank with the two ranks' global batch (without dropout, whose streams are per rank)."""
    work, log = root / "work", root / "losses.log"
    base = dict(work_dir=str(work), log=str(log), strategy=strategy, amp=amp, dropout=not reshard)
    nproc = RANKS.get(strategy, 2)
    start = time.perf_counter()
    proc = run({**base, "kill": f"{moment}:{k}"}, nproc)
    killed = proc.returncode != 0
    if proc.returncode not in (0, -signal.SIGKILL):
        return dict(error=f"killed run exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    resumed = run({**base, "resume": True, "batch": 4 * nproc}, 1) if reshard else run({**base, "resume": True}, nproc)
    if resumed.returncode != 0 and not completed(work, log):
        tail = resumed.stderr.strip().splitlines()[-3:]
        return dict(error=f"resume exited {resumed.returncode}: {' | '.join(tail)}")
    seen, resumes = losses(log)
    tol = RESHARD_TOLERANCE if reshard else 0.0
    wrong = [i for i, values in seen.items()
             if any(abs(float.fromhex(v) - float.fromhex(ref["losses"][i])) > tol for v in values)]
    missing = sorted(set(ref["losses"]) - set(seen))
    diff = compare(ref["state"], final_state(work))
    return dict(killed=killed, resumes=resumes, wrong_losses=wrong, missing=missing, diff=diff,
                seconds=time.perf_counter() - start)


def reference(root: Path, strategy: str, amp: bool, dropout: bool = True) -> dict:
    work, log = root / "work", root / "losses.log"
    proc = run(dict(work_dir=str(work), log=str(log), strategy=strategy, amp=amp, dropout=dropout),
               RANKS.get(strategy, 2))
    if proc.returncode != 0 and not completed(work, log):
        raise RuntimeError(f"the uninterrupted {strategy} run failed:\n{proc.stderr[-3000:]}")
    seen, _ = losses(log)
    assert sorted(seen) == list(range(ITERS)), sorted(seen)
    return dict(losses={i: v[0] for i, v in seen.items()}, state=final_state(work))


@functools.cache
def saves_at_window_end(strategy: str) -> bool:
    """The strategy keeps an accumulation window's partial gradients in its own buffers (its capabilities), so
    its checkpoint due inside a window is written at the window's end."""
    return not capabilities_of(STRATEGIES[strategy], 2).partial_gradients


def draw(rng: random.Random, strategies: list[str], n: int) -> list[tuple[str, str, int]]:
    """``n`` trials, strategies in turn, each a moment and an iteration where that moment exists."""
    out = []
    for i in range(n):
        moment = rng.choice(MOMENTS)
        saves = [j for j in range(SAVE_EVERY, ITERS, SAVE_EVERY)]
        evals = [j for j in range(VAL_EVERY, ITERS, VAL_EVERY)]
        k = rng.choice(saves) if moment in ("save", "pointer") else rng.choice(evals) if moment == "eval" \
            else rng.randrange(1, ITERS)
        strategy = strategies[i % len(strategies)]
        if moment in ("save", "pointer") and saves_at_window_end(strategy):
            k += k % ACCUMULATION  # its checkpoint due inside a window is written at the window's end
        out.append((strategy, moment, k))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=12, help="trials (each one killed run and its resume)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (slow on CPUs without native bf16)")
    parser.add_argument("--trials", help="these trials, not drawn ones: strategy:moment:K,... (ddp:before:5)")
    parser.add_argument("--reshard", action="store_true", help=f"resume on one rank with the global batch of two "
                        f"({', '.join(RESHARDABLE)}; no dropout); equal within {RESHARD_TOLERANCE}")
    parser.add_argument("--keep", help="keep the runs' work dirs under this folder")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",") if not args.reshard or args.strategies != ",".join(STRATEGIES) \
        else list(RESHARDABLE)
    if args.reshard and set(strategies) - set(RESHARDABLE):
        parser.error(f"--reshard: use strategies of {', '.join(RESHARDABLE)}")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r}: use {', '.join(STRATEGIES)}")
    trials = draw(random.Random(args.seed), strategies, args.kills) if not args.trials else \
        [(t.split(":")[0], t.split(":")[1], int(t.split(":")[2])) for t in args.trials.split(",")]
    root = Path(args.keep or tempfile.mkdtemp(prefix="memfit-chaos-"))
    refs, rows = {}, []
    print("| # | strategy | killed at | resumes | losses | final state | result | s |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (strategy, moment, k) in enumerate(trials, 1):
        if strategy not in refs:
            refs[strategy] = reference(root / f"reference-{strategy}", strategy, args.amp, not args.reshard)
        r = trial(root / f"trial-{i:03d}", strategy, moment, k, args.amp, refs[strategy], args.reshard)
        tol = RESHARD_TOLERANCE if args.reshard else 0.0
        exact = "error" not in r and not r["wrong_losses"] and not r["missing"] and r["diff"] <= tol
        rows.append(exact)
        if "error" in r:
            print(f"| {i} | {strategy} | {moment}:{k} | | | | LOST: {r['error']} | |", flush=True)
            continue
        loss_note = "equal" if not r["wrong_losses"] and not r["missing"] else \
            f"differ at {r['wrong_losses']}, missing {r['missing']}"
        state = "bit-exact" if r["diff"] == 0.0 else f"max diff {r['diff']:.3g}" + (" (within)" if exact else "")
        moment_note = f"{moment}:{k}" if r["killed"] else f"{moment}:{k} (never reached: not killed)"
        print(f"| {i} | {strategy} | {moment_note} | {r['resumes']} | {loss_note} | {state} "
              f"| {'nothing lost' if exact else 'LOST'} | {r['seconds']:.0f} |", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{sum(rows)}/{len(rows)} resumes with nothing lost")
    return 0 if all(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
