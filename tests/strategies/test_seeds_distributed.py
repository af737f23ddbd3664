"""The seeds' FSDP snippets run under torchrun with 2 CPU processes, imports changed only."""

from pathlib import Path

import pytest

from memfit.testing import launch, read_results


def test_seed_fsdp_snippets_under_torchrun(tmp_path):
    out = tmp_path / "out"
    proc = launch(Path(__file__).parent / "scripts" / "seeds_fsdp.py", 2, out_dir=out, timeout=240)
    r0, r1 = read_results(out, 2, proc)
    # model_wrapper_cfg=MMFullyShardedDataParallel(cpu_offload=True) -> FSDPStrategy with offload, sharded.
    assert r0["toy"]["strategy"] == "FSDPStrategy" and r0["toy"]["cpu_offload"] and r0["toy"]["world"] == 2
    assert r0["toy"]["iters"] == 13  # 50 samples, batch 2 per rank -> ceil(25 / 2)
    assert r0["toy"]["local_numel"] + r1["toy"]["local_numel"] == 1  # the 1x1 weight lives on one rank
    # size_based_auto_wrap_policy(min_num_params=1e7) over ResNet-50: layer4 (15M), then the rest (10.5M).
    assert r0["units"] == ["resnet", "resnet.layer4", ""]
    # AmpOptimWrapper with no dtype on a CPU without native bf16 (MEMFIT_CPU_BF16=0 in the tests): fp32.
    assert r0["precision"] == "fp32"
    # 7 validation images: the padded 8th is not counted, and the metric equals one-process evaluation.
    assert r0["size"] == r1["size"] == 7
    # The seed's metric returns a float32 tensor; one sample is 14.3 points, so rel=1e-6 only absorbs dtype.
    assert r0["accuracy"] == r1["accuracy"] == pytest.approx(r0["expected_accuracy"], rel=1e-6)
    # No strategy and no launcher under torchrun: the launcher is inferred and training is data parallel.
    assert r0["inferred"] == dict(strategy="DDPStrategy", launcher="pytorch", world=2, iters=13, same_on_ranks=True)


def test_launcher_is_inferred_and_an_explicit_none_under_torchrun_is_refused(monkeypatch):
    from memfit.dist import resolve_launcher
    from memfit.errors import ConfigError

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_launcher(None) == "none"
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun with 4 tasks
    assert resolve_launcher(None) == "slurm"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_launcher(None) == "pytorch"
    with pytest.raises(ConfigError, match="launcher='none' but this process is one of WORLD_SIZE=2"):
        resolve_launcher("none")
    with pytest.raises(ConfigError, match="launcher='mpi'"):
        resolve_launcher("mpi")
