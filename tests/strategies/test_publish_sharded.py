"""CheckpointHook ``published_keys`` (MMEngine's publish_model) on FSDP's sharded checkpoints: the
directory is gathered into one ``<name>-<sha256[:8]>.pth`` file holding only those keys, with full
tensors equal to the weights ``memfit export`` consolidates from the directory."""

import hashlib
import io
import os
import re
from pathlib import Path

import torch

from memfit.checkpoint import is_dcp_checkpoint, load_checkpoint, read_state_dict
from memfit.testing import launch, read_results

SCRIPT = Path(__file__).parent / "scripts" / "publish_sharded.py"


def test_sharded_checkpoints_are_published_as_one_file(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        # One run saving synchronously; one with background saves (its last checkpoint still being
        # written when training ends) that also publishes the optimizer state.
        proc = launch(SCRIPT, 2, ["sync:0:meta,state_dict", "bg:1:meta,state_dict,optim_wrapper"],
                      out_dir=tmp_path / "out", timeout=180)
        read_results(tmp_path / "out", 2, proc)
    finally:
        os.chdir(cwd)
    for run, keys in (("sync", {"meta", "state_dict"}), ("bg", {"meta", "state_dict", "optim_wrapper"})):
        work = tmp_path / run
        assert is_dcp_checkpoint(work / "iter_2.pth")
        [name] = [p.name for p in work.iterdir() if re.fullmatch(r"iter_2-[0-9a-f]{8}\.pth", p.name)]
        published = load_checkpoint(work / name)
        assert set(published) == keys
        # Named by the hash of its content, as MMEngine's _publish_model.
        buffer = io.BytesIO()
        torch.save(published, buffer)
        assert name == f"iter_2-{hashlib.sha256(buffer.getvalue()).hexdigest()[:8]}.pth"
        exported = read_state_dict(work / "iter_2.pth")
        assert sorted(published["state_dict"]) == sorted(exported)
        for key, value in exported.items():
            assert type(published["state_dict"][key]) is torch.Tensor and torch.equal(published["state_dict"][key],
                                                                                        value), key
        assert published["state_dict"]["blocks.0.weight"].shape == (8, 8)  # full tensors, not one rank's shard
    # AdamW's moments of every parameter, keyed by parameter name (the sharded form's optimizer layout).
    optim = load_checkpoint(tmp_path / "bg" / name)["optim_wrapper"]["optimizer"]
    assert optim["state"]["head.weight"]["exp_avg"].shape == (3, 8)
