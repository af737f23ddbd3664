"""ColossalAIStrategy: the DDP plugin on 2 CPU processes against one process, checkpoint and resume,
HybridAdam's lazy registration, CPU refusals; Gemini/LowLevelZero/HybridAdam on CUDA only."""

from __future__ import annotations

import os
from pathlib import Path

# `make venv` installs the extra: a broken install must fail these tests, not skip them.
import colossalai  # noqa: E402,F401
import pytest
import torch

from memfit.errors import ConfigError  # noqa: E402
from memfit.strategies.colossalai import ColossalAIStrategy  # noqa: E402
from memfit.testing import launch, read_results  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "colossal_runs.py"
GPU_ONLY = pytest.mark.skipif(
    torch.cuda.device_count() < 1,
    reason="colossalai 0.5: LowLevelZero asserts a CUDA device, Gemini and HybridAdam's kernels need CUDA",
)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("colossal")
    proc = launch(SCRIPT, 2, out_dir=out, timeout=300)
    result = read_results(out, 2, proc)[0]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return result


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ddp_plugin_matches_single_process(ddp, precision):
    r = ddp[precision]
    assert r["plugin"] == "TorchDDPPlugin"
    assert r["precision"] == ("bf16-mixed" if precision == "bf16" else "fp32")
    # k=2 over 2 ranks x 4 samples against the same 16-sample batches in one process (bf16: autocast
    # in both): bit-identical losses here; DDP's all-reduce order moves weights by ~3e-8.
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-6
    assert r["param_diff"] <= 1e-6


def test_ddp_plugin_resume_repeats_the_losses(ddp):
    assert ddp["resume"]["losses"] == ddp["fp32"]["losses"][2:]


def test_hybrid_adam_is_registered_lazily(ddp):
    from memfit.registry import OPTIMIZERS

    assert ddp["hybrid_adam_registered"] is True  # in the ranks, once a ColossalAIStrategy was set up
    assert "HybridAdam" not in OPTIMIZERS  # this process built none: memfit's import does not need colossalai


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("plugin", ["gemini", "lowlevel-zero"])
def test_sharded_plugins_are_refused_on_cpu(plugin):
    with pytest.raises(ConfigError, match="needs a CUDA device .* use plugin='ddp'"):
        ColossalAIStrategy(plugin=plugin).setup_env()


@pytest.mark.parametrize("kwargs, match", [
    (dict(plugin="gemni"), "strategy.plugin='gemni'.*gemini"),
    (dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
    (dict(config=dict(a=1)), "no longer takes a config"),
])
def test_bad_configs_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ColossalAIStrategy(**kwargs)


def test_plugin_names_and_precision_mapping():
    from memfit.connector import select_precision
    from memfit.precision import AutocastPrecision, HalfPrecision

    assert ColossalAIStrategy(plugin=dict(type="LowLevelZeroPlugin", stage=2)).plugin_kwargs == {"stage": 2}
    adamw = dict(optimizer=dict(type="AdamW", lr=1e-3))
    # The DDP plugin runs mixed_precision as torch autocast; the sharded plugins as their own precision.
    p = select_precision(adamw, ColossalAIStrategy(plugin="ddp", mixed_precision="bf16"))
    assert isinstance(p, AutocastPrecision) and p.dtype is torch.bfloat16
    p = select_precision(adamw, ColossalAIStrategy(plugin="gemini", mixed_precision="bf16"))
    assert isinstance(p, HalfPrecision) and p.dtype is torch.bfloat16
    with pytest.raises(ConfigError, match="the plugin owns precision"):
        select_precision(dict(adamw, type="AmpOptimWrapper", dtype="bfloat16"), ColossalAIStrategy(plugin="gemini"))


@GPU_ONLY
def test_gemini_and_lowlevel_zero_with_hybrid_adam_train_and_resume(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    proc = launch(SCRIPT, nproc, ["gpu"], out_dir=tmp_path, timeout=600,
                  env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")})
    r = read_results(tmp_path, nproc, proc)[0]
    for plugin in ("gemini", "lowlevel-zero"):
        assert r[plugin]["resumed"] == pytest.approx(r[plugin]["losses"][2:], abs=1e-6), plugin
