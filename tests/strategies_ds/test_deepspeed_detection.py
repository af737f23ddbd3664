"""A tiny DINO under DeepSpeed ZeRO-3 on 2 CPU processes (gloo) reproduces one process on the same global
batches (scripts/ds_detection.py, which reuses tests/strategies/scripts/detection_equivalence.py's model,
batches, reference and training loop; tests/strategies/test_detection_distributed.py explains how DINO's
denoising noise is handled).

Tolerances (test_deepspeed.py's): 1e-5 for every loss term and for the parameters, measured 1.9e-6 (losses of
~20) and 3.0e-6 (weights moved by up to 3e-3 in 3 AdamW steps of lr 1e-3). The attention key biases, whose
exact gradient is zero so that their Adam steps follow rounding noise (measured 1.9e-4), are only bounded,
as in the FSDP test. The strategy sets ``gradient_clipping=0.0``: DeepSpeed 0.19's own default is 1.0, which
would clip these gradients (norm 15) where the one-process reference does not.
"""

from __future__ import annotations

from pathlib import Path

# `make venv` installs the extra: a broken install must fail these tests, not skip them.
import deepspeed  # noqa: F401
import pytest

from memfit.testing import DEEPSPEED_PRELOAD, launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "ds_detection.py"
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
LR, STEPS = 1e-3, 3  # the script's


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ds_detection")
    proc = launch(SCRIPT, 2, out_dir=out, timeout=300, preload=DEEPSPEED_PRELOAD)
    results = read_results(out, 2, proc)
    if proc.returncode != 0:  # tolerated only when every rank finished (DeepSpeed/gloo teardown abort)
        assert all("world_size" in r for r in results), proc.stderr[-4000:]
    return results


def test_zero3_dino_matches_one_process(results):
    r0, r1 = results
    run, ref = r0["zero3"], r0["ref"]
    assert r0["world_size"] == 2
    assert run["zero_stage"] == 3 and run["global_steps"] == STEPS and run["param_dtype"] == "torch.float32"
    # ZeRO-3 partitions every parameter: each rank holds about half of the 1.4 M (padded to the world size).
    assert run["local_numel"] + r1["zero3"]["local_numel"] - run["numel"] in range(0, 2 * 200)
    assert run["losses"] == r1["zero3"]["losses"]  # the global loss terms, identical on both ranks
    assert max(abs(s[k] - r[k]) for s, r in zip(run["losses"], ref["losses"], strict=True) for k in r) <= LOSS_TOL
    assert run["param_diff"] <= PARAM_TOL < ref["moved"] / 100  # gathered from the ZeRO-3 partitions
    assert run["key_bias_diff"] <= 2 * LR * STEPS
