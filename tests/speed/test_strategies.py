"""The speed levers compose with the strategies (scripts/strategies.py, 2 CPU processes): a model compiled
whole still runs through DDP's wrapper (its gradients are reduced: both ranks hold the same weights),
regional compile with activation checkpointing under FSDP2, and fused AdamW stepping FSDP2's DTensor
shards and under ZeRO-1; each trains the weights of the same run without the lever."""

from pathlib import Path

import pytest

from memfit.testing import launch, max_diff, read_results

SCRIPTS = Path(__file__).parent / "scripts"
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed_strategies")
    proc = launch(SCRIPTS / "strategies.py", nproc=2, out_dir=out, timeout=240)
    return read_results(out, 2, proc)


@pytest.mark.parametrize("variant, reference, compiled, tol", [
    # aot_eager runs the traced graph with eager's kernels: bit-identical.
    ("ddp_whole", "ddp", [""], 0.0),
    ("ddp_regional", "ddp", BLOCKS, 0.0),
    ("fsdp_regional_ckpt", "fsdp", BLOCKS, 0.0),
    # One fused kernel against torch's foreach AdamW: the same update in another order of fp32 operations.
    ("fsdp_fused", "fsdp", [], 1e-6),
    ("zero1_fused", "zero1", [], 1e-6),  # ZeroRedundancyOptimizer builds the fused AdamW over its shard
])
def test_lever_trains_what_the_strategy_trains_without_it(results, variant, reference, compiled, tol):
    r0, r1 = results
    assert r0[variant]["params"] == r1[variant]["params"]  # gradients reduced across the ranks
    assert r0[variant]["compiled"] == compiled
    assert max(abs(a - b) for a, b in zip(r0[variant]["losses"], r0[reference]["losses"])) <= tol
    assert max_diff(r0[variant]["params"], r0[reference]["params"]) <= tol
