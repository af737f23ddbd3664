"""A step run through a bounded launch queue, against the step-time model's one maximum over the step.

    python benchmarks/launch_queue.py PREDICTED.csv RUN.json [--queue 1024,2048,4096]

The planner times a GPU step as the slower of its kernels and its host over the whole step. A step whose parts
differ (DINO: a device-paced backbone, then host-paced heads and matching) takes longer: the host runs ahead of the
device by at most a queue of launches, and the device waits for the host wherever the host is slower. This runs
each case's fake forward/backward once more on this CPU (``gpu_calibration.py``'s cases), records its operators in
segments of 64 in order (operators, FLOPs, bytes written), times each segment as the planner would
(:func:`memfit.planner.cost.micro_step_parts`), scales the segments to the case's predicted kernels and host
(PREDICTED.csv, from ``gpu_calibration.py compare --composed``) and runs them through a queue of QUEUE operators:
the host issues segment after segment, waiting while the queue is full; the device runs each once issued, after
the one before. Prints each case's step relative to its reference (``step_time_table.py``'s), measured (RUN.json),
by the model and by the queue at each depth, with the errors. A way to test the idea against measured steps, not
(yet) the planner's model: its timeline (a profiled step's ``timeline``) is what it is to be fitted to.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
SEGMENT = 64  # operators per segment


def segments(names: list[str]) -> dict[str, tuple[Any, list[tuple[int, ...]]]]:
    """Each case's plan and its forward/backward as (operators, FLOPs, convolution FLOPs, attention FLOPs, bytes
    written) per segment of :data:`SEGMENT` operators, in order."""
    import gpu_calibration as gc

    from memfit.planner import op_counter
    from memfit.planner.fake import fake_process_group, measure_step

    out: dict[str, tuple[Any, list[tuple[int, ...]]]] = {}
    current: list[list[int]] = []
    counted = op_counter.OpCounter.__call__

    def call(self, func, args, kwargs, result):  # noqa: ANN001, ANN202 - OpCounter's own signature
        before = (self.ops, self.flops, self.conv_flops, self.attn_flops, self.written)
        counted(self, func, args, kwargs, result)
        if self.ops != before[0]:
            if not current or current[-1][0] >= SEGMENT:
                current.append([0] * 5)
            now = (self.ops, self.flops, self.conv_flops, self.attn_flops, self.written)
            for i in range(5):
                current[-1][i] += now[i] - before[i]

    op_counter.OpCounter.__call__ = call
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = gc._data(tmp)
            for name in names:
                _, spec, options, words = next(c for c in gc.CASES if c[0] == name)
                cfg = gc._config(spec, options, data)
                plan, facts = gc._plan(cfg, words, cuda=True)
                current.clear()
                with fake_process_group(1):
                    measure_step(plan.apply(cfg, facts), full=False, cuda=True)
                out[name] = plan, [tuple(s) for s in current]
                print(f"{name}: {sum(s[0] for s in current)} operators", file=sys.stderr, flush=True)
    finally:
        op_counter.OpCounter.__call__ = counted
    return out


def queued(kernels: list[float], host: list[float], depth: int) -> float:
    """Seconds of segments whose kernels take ``kernels`` and whose launches take ``host``, the host at most
    ``depth`` operators (``depth // SEGMENT`` segments) ahead of the device."""
    lag = max(1, depth // SEGMENT)
    issued, done = [0.0], [0.0]
    for i, (k, h) in enumerate(zip(kernels, host)):
        start = issued[-1] if i < lag else max(issued[-1], done[i - lag + 1])  # a full queue: wait for a slot
        issued.append(start + h)
        done.append(max(done[-1] + k, issued[-1] + k / SEGMENT))
    return max(issued[-1], done[-1])


def main() -> None:
    from step_time_table import reference_of

    from memfit.planner.cost import micro_step_parts
    from memfit.planner.devices import GPUS
    from memfit.planner.time_profile import profile_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("predicted")
    parser.add_argument("run")
    parser.add_argument("--queue", default="1024,2048,4096", help="queue depths, in operators the fake step counts")
    args = parser.parse_args()
    depths = [int(q) for q in args.queue.split(",")]
    with open(args.predicted, newline="") as f:
        predicted = {r["case"]: r for r in csv.DictReader(f) if r.get("predicted_kernels_s")}
    measured = {m["case"]: m["seconds"] for m in json.loads(Path(args.run).read_text()) if "seconds" in m}
    names = [n for n in predicted if n in measured and reference_of(n) in predicted and reference_of(n) in measured]
    device = GPUS["H100"]
    profile = profile_for(device)[0]
    seconds: dict[str, list[float]] = {}
    for name, (plan, segs) in segments(names).items():
        row, k = predicted[name], plan.accumulative_counts
        seg_kernels = [micro_step_parts(plan, SimpleNamespace(ops=s[0], flops=s[1], conv_flops=s[2], attn_flops=s[3],
                                                              written=s[4], recompute_ops=0), device, profile)[0]
                       for s in segs]
        total_kernels, total_host = float(row["predicted_kernels_s"]), float(row["predicted_host_s"])
        ops = sum(s[0] for s in segs)
        kernels = [x * total_kernels / (sum(seg_kernels) * k) for x in seg_kernels]
        host = [s[0] / ops * total_host / k for s in segs]
        offload = float(row.get("predicted_offload_s") or 0)  # waited for after the step's compute
        seconds[name] = [float(row["predicted_step_s"]), *(k * queued(kernels, host, q) + offload for q in depths)]
    head = ["case", "measured", "model", *[f"queue {q}" for q in depths]]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, times in seconds.items():
        ref = reference_of(name)
        if name == ref or ref not in seconds:
            continue
        want = measured[name] / measured[ref]
        cells = [f"{want:.3f}"] + [f"{t / r / want - 1:+.1%}" for t, r in zip(times, seconds[ref])]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
