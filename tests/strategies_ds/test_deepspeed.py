"""DeepSpeedStrategy: ZeRO 0-3 x precision x offload against one process, accumulation, kill-and-resume,
export, load_from, the seed's snippet and its failure mode, on 2 CPU processes (gloo).

The distributed runs are batched into three launches (each pays Python's, torch's and deepspeed's imports),
shared by the tests that read them: the ZeRO equivalence cases run in the launch that resumes. DeepSpeed
with gloo can abort at process teardown after the work is done; a launch is accepted with a non-zero exit
only when every rank wrote the result of its last command, so a real failure (a rank that died before
finishing) still fails the test with the launcher's output.
"""

from __future__ import annotations

from pathlib import Path

# `make venv` installs the extra: a broken install must fail these tests, not skip them.
import deepspeed  # noqa: E402,F401
import pytest
import torch
from torch import nn

from memfit.errors import ConfigError  # noqa: E402
from memfit.testing import DEEPSPEED_PRELOAD, launch, read_results  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
# Exactness: fp32 and bf16-autocast runs reproduce the reference bit for bit on this machine; ZeRO-0
# all-reduces in another summation order (measured 3e-8). Tolerances leave room for other CPUs.
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
CASES = ["0-fp32-none-2", "1-fp32-none-1", "2-fp32-opt-2", "3-fp32-none-1", "3-fp32-all-2",
         "0-amp-none-1", "1-amp-opt-2", "2-amp-none-1", "3-amp-opt-1", "3-amp-all-2"]


def run(script: str, args: list[str], out: Path, nproc: int = 2, last: str | None = None,
        name: str = "rank") -> list[dict]:
    proc = launch(SCRIPTS / script, nproc, args, out_dir=out, timeout=420, preload=DEEPSPEED_PRELOAD)
    results = read_results(out, nproc, proc, name=name)
    if proc.returncode != 0:
        # Tolerated only when every rank finished its last command (DeepSpeed/gloo teardown abort).
        assert last is not None and all(last in r for r in results), proc.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def equivalence(runs) -> dict:
    return runs["equivalence"]  # scripts/ds_equivalence.py's cases, run by scripts/ds_runs.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """full run; killed run; resumed run + export; the seed's snippet; the failure miniature; the ZeRO
    equivalence cases; one process."""
    out = tmp_path_factory.mktemp("ds_runs")
    full = run("ds_runs.py", [f"full:{out / 'full'}", f"kill:{out / 'killed'}"], out / "a", last="full")[0]
    killed = read_results(out / "a", 2, name="kill")[0]
    # The one-process run reads the weights the resumed run exported into its output folder.
    rest = run("ds_runs.py", [f"resume:{out / 'killed'}", "seed", "dino", f"equivalence:{','.join(CASES)}"],
               out / "b", last="equivalence")[0]
    single = run("ds_runs.py", [f"single:{out / 'killed'}"], out / "b", nproc=1, last="single")[0]
    return {**full, "kill": killed, **rest, **single}


# -- 2 processes against one ---------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_zero_matches_single_process(equivalence, case):
    r = equivalence[case]
    stage, precision, offload, k = case.split("-")
    assert equivalence["world_size"] == 2
    assert r["zero_stage"] == int(stage) and r["autocast"] == (precision == "amp")
    assert r["offload_optimizer"] == (offload != "none")
    assert r["param_dtype"] == "torch.float32"  # autocast keeps fp32 parameters and master weights
    assert r["micro_batch"] == 4 and r["gas"] == int(k)  # filled from the loader and accumulative_counts
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= LOSS_TOL
    assert r["param_diff"] <= PARAM_TOL < r["param_moved"] / 100  # the weights moved, and identically
    assert r["trace"] is (True if stage == "3" else None)  # ZeRO-3 prefetches from a complete trace


def test_accumulation_matches_large_batch(equivalence):
    # k=2: one optimizer step per two micro-batches of 2 ranks x 4 = one step on the 16-sample batch
    # (the reference accumulates loss/2 over the same samples: the large batch's mean loss).
    for case in (c for c in CASES if c.endswith("-2")):
        r = equivalence[case]
        assert r["global_steps"] == 3, case  # 6 micro-steps
        assert r["param_diff"] <= PARAM_TOL, case


# -- checkpoints -------------------------------------------------------------------------------
def test_kill_and_resume_continues_with_same_losses(runs):
    full = runs["full"]["losses"]
    assert len(full) == 8
    assert runs["kill"]["losses"] == full[:4]  # the killed run, up to its iteration-4 checkpoint
    assert runs["resume"]["losses"] == full[4:]  # resumed: the same losses, bit for bit
    assert runs["resume"]["state"] == runs["full"]["state"]
    assert runs["resume"]["lr"] == pytest.approx(runs["full"]["lr"])  # the LinearLR schedule resumed too
    assert runs["resume"]["latest"].endswith("iter_8.pth")
    assert {"engine", "memfit_state.pth"} <= set(runs["resume"]["files"])


def test_export_consolidates_zero3_shards(runs):
    r = runs["resume"]
    assert sorted(r["exported"]) == sorted(r["state"])
    assert r["exported"] == r["state"]  # fp32 master weights, gathered from both ranks' shards


def test_resume_at_another_world_size_is_a_clear_error(runs):
    error = runs["single"]["error"]
    assert runs["single"]["world_size"] == 1
    assert "saved by 2 ranks, this run has 1" in error
    assert "memfit export" in error and "ds_to_universal" in error


def test_load_from_reaches_zero3_shards_and_master_weights(runs):
    # Loaded into a 1-rank ZeRO-3 run and trained 2 steps at lr=0: unchanged only if the optimizer's
    # fp32 master copy was refreshed from the loaded weights.
    assert runs["single"]["load_from_diff"] == 0.0


# -- the seeds ---------------------------------------------------------------------------------
def test_seed_flexible_runner_deepspeed_snippet(runs):
    r = runs["seed"]
    assert r["iters"] == 2 and r["stage"] == 3
    assert r["param_dtype"] == "torch.bfloat16"  # the whole-model mode the seed asked for
    assert r["bn_stats_dtype"] == "torch.float32"  # BatchNorm statistics kept in fp32 (bn_fp32)
    assert {"engine", "memfit_state.pth"} <= set(r["checkpoint"])
    assert "accuracy/top1" in r["val_metrics"]


def test_whole_model_half_stalls_where_autocast_trains(runs):
    # A confident wrong classifier (sigmoid(8) rounds to 1.0 in bf16) under a hand-written BCE with a
    # 1e-5 epsilon: whole-model bf16 gets zero gradients and never moves; memfit's autocast with the
    # loss as an fp32 island learns.
    half, amp = runs["dino"]["whole_model_bf16"], runs["dino"]["memfit_autocast"]
    assert half["bias"] == 8.0
    assert sum(half["losses"][-5:]) >= 0.9 * sum(half["losses"][:5])
    assert amp["bias"] < 6.0
    assert sum(amp["losses"][-5:]) < 0.5 * sum(amp["losses"][:5])


# -- configuration (no process group) ----------------------------------------------------------
def _strategy(**kwargs):
    from memfit.strategies.deepspeed import DeepSpeedStrategy

    s = DeepSpeedStrategy(**kwargs)
    s.set_micro_batch_size(4)
    return s


def _config(s, wrapper: dict) -> dict:
    """The DeepSpeed config ``s`` builds for this optim_wrapper (precision chosen by the connector)."""
    from memfit.connector import resolve_optim_wrapper, select_precision

    wrapper = resolve_optim_wrapper({"optimizer": dict(type="AdamW", lr=1e-3), **wrapper}, s)
    select_precision(wrapper, s)
    return s.build_config(wrapper.get("accumulative_counts", 1), wrapper.get("clip_grad"))


def test_config_fills_batch_accumulation_clipping_and_autocast():
    s = _strategy(zero_optimization=dict(stage=3, cpu_offload=False, offload_optimizer=dict(device="cpu")))
    cfg = _config(s, dict(type="AmpOptimWrapper", dtype="bfloat16", accumulative_counts=4,
                          clip_grad=dict(max_norm=1.0)))
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cfg["zero_force_ds_cpu_optimizer"] is False and "fp16" not in cfg and s.half_dtype is None
    assert cfg["zero_allow_untested_optimizer"] is True  # SGD/LARC under ZeRO (found via memfit train --gpus 2)


def test_no_clip_grad_means_no_clipping_and_the_strategy_key_still_works():
    # DeepSpeed 0.19 clips at 1.0 by default: without clip_grad memfit turns that off (found by the DINO test).
    assert _config(_strategy(zero_optimization=dict(stage=2)), {})["gradient_clipping"] == 0.0
    assert _config(_strategy(gradient_clipping=2.0), {})["gradient_clipping"] == 2.0


@pytest.mark.parametrize("kwargs, wrapper, match", [
    (dict(train_micro_batch_size_per_gpu=8), {}, "disagrees with train_dataloader.batch_size"),
    (dict(gradient_accumulation_steps=2), {}, "disagrees with optim_wrapper.accumulative_counts"),
    (dict(fp16=dict(enabled=True)), {}, "has no fp16 mode"),
    (dict(bf16=dict(enabled=True)), dict(type="AmpOptimWrapper"), "two precisions"),
    (dict(torch_autocast=dict(enabled=True, dtype="float16")), dict(type="AmpOptimWrapper", dtype="bfloat16"),
     "disagree"),
    (dict(amp=dict(enabled=True)), dict(type="AmpOptimWrapper", dtype="bfloat16"), "disagree"),
    ({}, dict(type="AmpOptimWrapper", dtype="float16", loss_scale=512.0), "dynamic GradScaler"),
])
def test_config_errors_name_the_key(kwargs, wrapper, match):
    s = _strategy(**kwargs)
    with pytest.raises(ConfigError, match=match):
        _config(s, wrapper)


def test_whole_model_half_warns_with_the_risk(caplog):
    s = _strategy(bf16=dict(enabled=True), inputs_to_half=[0])
    with caplog.at_level("WARNING", logger="memfit"):
        cfg = _config(s, {})
    assert cfg["bf16"]["enabled"] and "torch_autocast" not in cfg
    assert s.half_dtype is torch.bfloat16
    assert "casts the whole model" in caplog.text and "AmpOptimWrapper" in caplog.text


def test_inputs_to_half_casts_positions_and_keys():
    from memfit.strategies.deepspeed_half import cast_inputs

    x, y = torch.randn(2, 3), torch.tensor([1, 2])
    a, b = cast_inputs([x, y], [0], torch.bfloat16)
    assert a.dtype is torch.bfloat16 and b.dtype is torch.long
    d = cast_inputs({"inputs": x, "labels": y}, ["inputs"], torch.bfloat16)
    assert d["inputs"].dtype is torch.bfloat16
    assert cast_inputs([x, y], [0], None)[0].dtype is torch.float32  # autocast mode: untouched
    with pytest.raises(ConfigError, match="positional inputs"):
        cast_inputs([x], [3], torch.bfloat16)


def test_batchnorm_fp32_in_half_mode_matches_fp32_batchnorm():
    from memfit.strategies.deepspeed_half import keep_batchnorm_fp32

    torch.manual_seed(0)
    ref, plain, half = nn.BatchNorm2d(4), nn.BatchNorm2d(4).bfloat16(), nn.BatchNorm2d(4).bfloat16()
    assert keep_batchnorm_fp32(nn.Sequential(half)) == ["0"]
    for _ in range(50):
        x = (torch.randn(8, 4, 3, 3) + 100.3).bfloat16()
        ref(x.float())
        plain(x)
        out = half(x)
    assert out.dtype is torch.bfloat16 and half.running_mean.dtype is torch.float32
    torch.testing.assert_close(half.running_mean, ref.running_mean, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(half.running_var, ref.running_var, atol=1e-4, rtol=1e-5)
    assert (plain.running_mean.float() - ref.running_mean).abs().max() > 0.1  # bf16 statistics drift


def test_deepspeed_optim_wrapper_needs_the_strategy():
    from memfit.connector import resolve_optim_wrapper
    from memfit.strategies import SingleDeviceStrategy

    cfg = dict(type="DeepSpeedOptimWrapper", optimizer=dict(type="SGD", lr=1))
    with pytest.raises(ConfigError, match="needs strategy=dict\\(type='DeepSpeedStrategy'"):
        resolve_optim_wrapper(cfg, SingleDeviceStrategy())
    assert resolve_optim_wrapper(cfg, _strategy())["type"] == "OptimWrapper"


def test_short_names_point_at_deepspeed_config():
    from memfit.strategies import SHORT_NAMES, build_strategy

    for name, stage in (("deepspeed_stage_1", 1), ("deepspeed_stage_2", 2), ("deepspeed_stage_3", 3)):
        assert build_strategy(name).ds_config["zero_optimization"]["stage"] == stage
    offload = build_strategy("deepspeed_stage_3_offload").ds_config["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == "cpu" and offload["offload_param"]["device"] == "cpu"
    assert SHORT_NAMES["deepspeed_stage_3"]["type"] == "DeepSpeedStrategy"


def test_deepspeed_internal_loads_are_weights_only(tmp_path):
    """DeepSpeed's loaders call torch.load(weights_only=False); memfit forces weights_only with an allowlist."""
    import os

    from deepspeed.runtime.zero.config import ZeroStageEnum

    from memfit.checkpoint.deepspeed import weights_only_loads
    from memfit.errors import CheckpointError

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil, ok = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "ok.pt"
    torch.save({"module": {}, "x": Payload()}, evil)
    torch.save({"zero_stage": ZeroStageEnum.weights, "module": {"w": torch.ones(2)}}, ok)
    with weights_only_loads():
        assert torch.equal(torch.load(ok, weights_only=False)["module"]["w"], torch.ones(2))
        with pytest.raises(CheckpointError, match="refuses to unpickle"):
            torch.load(evil, weights_only=False)
    assert not marker.exists()


def test_zero2_optimizer_partitions_load_weights_only(tmp_path):
    """ZeRO-1/2 optimizer files pickle the (numel, start) address of each partition's fragments: they load
    with memfit's weights-only allowlist (``memfit export`` and one-process reads of such checkpoints)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from memfit.checkpoint.deepspeed import weights_only_loads

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"param_slice_mappings": [{"w": fragment_address(numel=4, start=2)}], "t": torch.ones(2)}, path)
    with weights_only_loads():
        state = torch.load(path, weights_only=False)  # as DeepSpeed calls it
    assert state["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=2)
