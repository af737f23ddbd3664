"""``memfit train CFG --gpus N`` spawns torchrun; the launch flags never reach the children."""

import os
import subprocess
import sys
import textwrap

import pytest

from memfit.checkpoint import is_dcp_checkpoint
from memfit.errors import ConfigError
from memfit.launch import strip_launch_flags, torchrun_command


def test_strip_launch_flags():
    argv = ["train", "c.py", "--gpus", "8", "--nnodes=2", "--node-rank", "1", "--master-addr", "10.0.0.1",
            "--master-port=1234", "--amp"]
    assert strip_launch_flags(argv) == ["train", "c.py", "--amp"]


def test_torchrun_command_multi_node_and_rendezvous():
    cmd = torchrun_command(["train", "c.py"], 4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=1234"} <= set(cmd)
    assert cmd[-4:] == ["-m", "memfit", "train", "c.py"]
    rdzv = torchrun_command(["train", "c.py"], 2, nnodes=3, rdzv_endpoint="head:29400")
    assert "--rdzv-endpoint=head:29400" in rdzv and not any(a.startswith("--node-rank") for a in rdzv)
    with pytest.raises(ConfigError, match="node rank"):
        torchrun_command(["train"], 2, nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="--gpus 0"):
        torchrun_command(["train"], 0)


CONFIG = textwrap.dedent("""
    _data = dict(type='ShapesDataset', image_size=16, num_classes=4)
    model = dict(type='TimmClassifier', model_name='vit_tiny_patch16_224', num_classes=4, img_size=16,
                 patch_size=8, embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.0)
    train_dataloader = dict(batch_size=2, dataset=dict(**_data, num_samples=16),
                            sampler=dict(type='DefaultSampler', shuffle=True))
    val_dataloader = dict(batch_size=2, dataset=dict(**_data, num_samples=7, split='val'),
                          sampler=dict(type='DefaultSampler', shuffle=False))
    val_evaluator = dict(type='Accuracy')
    train_cfg = dict(by_epoch=False, max_iters=2, val_interval=2)
    val_cfg = dict()
    optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
    strategy = 'fsdp'
    default_hooks = dict(checkpoint=dict(interval=2, by_epoch=False), logger=dict(interval=1))
    randomness = dict(seed=0)
""")


def test_train_gpus_2_runs_fsdp_on_two_processes(tmp_path):
    cfg = tmp_path / "tiny.py"
    cfg.write_text(CONFIG)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    from memfit.testing import free_port

    proc = subprocess.run([sys.executable, "-m", "memfit", "train", str(cfg), "--gpus", "2", "--work-dir",
                           str(tmp_path / "wd"), "--master-port", str(free_port())],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "FSDPStrategy on cpu, world size 2" in log
    assert is_dcp_checkpoint(tmp_path / "wd" / "iter_2.pth")
    assert len(list((tmp_path / "wd" / "iter_2.pth").glob("*.distcp"))) == 2  # one shard file per rank


def test_slurm_variables_become_torchrun_variables(monkeypatch):
    from memfit import dist

    # A private copy of the environment: _env_from_slurm sets RANK etc., which must not leak into later
    # tests' subprocesses (monkeypatch.delenv does not undo keys that were absent before).
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keys})
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("MASTER_ADDR", "node001")  # else taken from `scontrol show hostnames`
    dist._env_from_slurm()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "16", "1")
    assert os.environ["MASTER_ADDR"] == "node001" and os.environ["MASTER_PORT"] == "29500"


def test_the_group_memfit_joins_is_destroyed_before_interpreter_exit():
    """Left to interpreter finalization, gloo's threads can abort a rank after training finished (SIGABRT,
    "terminate called without an active exception"): memfit destroys its group at exit."""
    script = textwrap.dedent("""
        import atexit
        import torch.distributed as tdist
        # registered first, so it runs last: after memfit's teardown
        atexit.register(lambda: print("initialized at exit:", tdist.is_initialized()))
        from memfit import dist
        dist.ensure_process_group()
        assert tdist.is_initialized()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialized at exit: False" in proc.stdout
