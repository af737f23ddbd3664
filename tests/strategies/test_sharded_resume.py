"""Sharded (DCP) checkpoints saved at world size 2 resume at 1 and 2 (and 1 -> 2) with the same
losses as an uninterrupted run and no sample skipped or repeated; ZeRO-1 checkpoints likewise."""

import os
import runpy
import sys
from pathlib import Path

import pytest

from memfit.checkpoint import is_dcp_checkpoint, read_latest
from memfit.testing import launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "train_resume.py"
TOL = 1e-5  # a different world size changes only the order of the gradient reduction


def _one_process(out: Path, name: str, runs: list[str]) -> dict:
    """The runs at world size 1, in this process (train_resume.py as ``__main__``, unlaunched: the one-process
    group memfit joins without RANK/WORLD_SIZE), so that no process pays the imports again."""
    import torch.distributed as tdist

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMFIT_TEST_OUT", str(out))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(k, raising=False)
        mp.setattr(sys, "argv", [str(SCRIPT), name, *runs])
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        finally:
            if tdist.is_initialized():
                tdist.destroy_process_group()
    return read_results(out, 1, name=name)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    out = root / "out"
    cwd = os.getcwd()
    os.chdir(root)
    try:
        proc = launch(SCRIPT, 2, ["A", "fsdp:w2_fsdp", "ddp_zero:w2_zero", "fsdp_optoffload:w2_off"], out_dir=out,
                      timeout=240)
        a = read_results(out, 2, proc, name="A")[0]
        b = _one_process(out, "B", ["fsdp:r1_fsdp:w2_fsdp/iter_4.pth", "single:r1_single:w2_fsdp/iter_4.pth",
                                    "ddp_zero:r1_zero:w2_zero/iter_4.pth", "fsdp:w1_fsdp",
                                    "fsdp_optoffload:r1_off:w2_off/iter_4.pth",
                                    "single:r1_from_off:w2_off/iter_4.pth"])
        proc = launch(SCRIPT, 2, ["C", "fsdp:r2_fsdp:w2_fsdp/iter_4.pth", "fsdp:r12_fsdp:w1_fsdp/iter_4.pth",
                                  "fsdp_optoffload:r2_off:w2_fsdp/iter_4.pth"], out_dir=out, timeout=240)
        c = read_results(out, 2, proc, name="C")[0]
    finally:
        os.chdir(cwd)
    return root, a, b, c


def _check_continuation(full: list, resumed: list) -> None:
    assert [r[0] for r in resumed] == [5, 6, 7, 8, 9]
    tail = full[4:]
    for (it, loss, seen), (it2, loss2, seen2) in zip(tail, resumed):
        assert it == it2 and seen == seen2, (it, seen, seen2)
        assert abs(loss - loss2) <= TOL, (it, loss, loss2)


def test_layout_and_pointer(runs):
    root, a, _, _ = runs
    assert a["world_size"] == 2
    for n in (4, 8, 9):
        assert is_dcp_checkpoint(root / "w2_fsdp" / f"iter_{n}.pth")
        assert (root / "w2_fsdp" / f"iter_{n}.pth" / "memfit_state.pth").is_file()
    assert read_latest(root / "w2_fsdp") == root / "w2_fsdp" / "iter_9.pth"
    assert not [p for p in (root / "w2_fsdp").iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert (root / "w2_zero" / "iter_4.pth").is_file()  # ZeRO-1: consolidated into one file


def test_no_sample_skipped_or_repeated(runs):
    _, a, _, _ = runs
    rows = a["fsdp:w2_fsdp"]
    # 9 iterations of 4 over 24 samples: the first 6 iterations are one epoch, each sample once.
    first_epoch = sorted(i for r in rows[:6] for i in r[2])
    assert first_epoch == list(range(24))


def test_resume_2_to_1(runs):
    _, a, b, _ = runs
    full = a["fsdp:w2_fsdp"]
    _check_continuation(full, b["fsdp:r1_fsdp"])  # FSDP at world size 1 reads the shards in place
    _check_continuation(full, b["single:r1_single"])  # one process, gathered without sharding
    _check_continuation(a["ddp_zero:w2_zero"], b["ddp_zero:r1_zero"])


def test_resume_2_to_2_and_1_to_2(runs):
    _, a, b, c = runs
    _check_continuation(a["fsdp:w2_fsdp"], c["fsdp:r2_fsdp"])
    _check_continuation(b["fsdp:w1_fsdp"], c["fsdp:r12_fsdp"])
    # And the world-size-1 run is the world-size-2 run (same global batch and samples).
    for (_, loss, seen), (_, loss2, seen2) in zip(a["fsdp:w2_fsdp"], b["fsdp:w1_fsdp"]):
        assert seen == seen2 and abs(loss - loss2) <= TOL


def test_optimizer_offload_resumes_at_any_world_size_with_or_without_it(runs):
    _, a, b, c = runs
    full = a["fsdp_optoffload:w2_off"]
    # Offloading the optimizer changes no bit of training (the same AdamW on the same shards).
    assert [r[1] for r in full] == [r[1] for r in a["fsdp:w2_fsdp"]]
    _check_continuation(full, b["fsdp_optoffload:r1_off"])  # offloaded 2 -> offloaded 1
    _check_continuation(full, b["single:r1_from_off"])  # offloaded 2 -> one process without offload
    _check_continuation(a["fsdp:w2_fsdp"], c["fsdp_optoffload:r2_off"])  # plain 2 -> offloaded 2


def test_export_consolidates_a_sharded_checkpoint(runs):
    from safetensors.torch import load_file

    from memfit.checkpoint import export_safetensors

    root, _, _, _ = runs
    out = export_safetensors(root / "w2_fsdp" / "iter_9.pth", root / "model.safetensors")
    tensors = load_file(out)
    assert tensors["head.weight"].shape == (3, 8) and tensors["blocks.0.weight"].shape == (8, 8)
