"""Rank script: the real per-rank peak of each config in a JSON file, measured as ``memfit bench`` does.

``torchrun --nproc-per-node 2 measured_peaks.py CASES.json``: CASES.json maps a case name to a config
dict (JSON-able: the distributed cases need no classes). Every rank runs every case with
:func:`memfit.planner.bench.measure_plan` (a warm-up step, one step under memfit's tracker, one
timed step) on its share of the data, and writes ``{name: {"peak", "breakdown", "seconds"}}``. One
launch covers all cases: a torchrun start costs seconds of imports.

gloo's reduce-scatter copies its whole input inside C++, outside the dispatcher: the tracker first
sees that copy as an operator input and counts it as alive for the whole step (``inputs``, one
FSDP unit's unsharded gradients per reduce-scatter). NCCL reduces in place. FSDP's reduce-scatter
therefore runs here as an in-place all-reduce of FSDP's own input buffer and a copy of this rank's
chunk into FSDP's output: the same result and the bytes NCCL allocates (none beyond FSDP's buffers).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as tdist

from memfit.planner.bench import measure_plan
from memfit.planner.fake import build_meta_model
from memfit.planner.space import ModelFacts, configured_plan
from memfit.testing import write_result


def _reduce_scatter_in_place(output: torch.Tensor, input: torch.Tensor, op=tdist.ReduceOp.SUM, group=None,
                             async_op: bool = False) -> None:
    tdist.all_reduce(input, op=op, group=group)
    rank, world = tdist.get_rank(group), tdist.get_world_size(group)
    output.copy_(input.view(world, -1)[rank].view_as(output))


def main(path: str) -> None:
    tdist.reduce_scatter_single = _reduce_scatter_in_place  # FSDP2 looks it up on the module at each call
    results = {}
    for name, cfg in json.loads(open(path).read()).items():
        facts = ModelFacts.of(build_meta_model(cfg["model"]))
        m = measure_plan(cfg, configured_plan(cfg, facts, cuda=False), facts, steps=1)
        results[name] = {"peak": m.peak_bytes, "breakdown": m.breakdown, "seconds": m.seconds}
    write_result(results)


if __name__ == "__main__":
    main(sys.argv[1])
