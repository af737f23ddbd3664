"""``memfit train CFG --gpus N``: start the same command under torchrun, one process per device.

torchrun (``torch.distributed.run``) does the work: it spawns ``N`` processes per node, sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, and with ``--nnodes`` and
``--node-rank`` (or a rendezvous endpoint) joins several machines. Each child runs
``python -m memfit train CFG ...`` with the launch flags removed; memfit's CLI sees ``RANK`` and
sets ``launcher='pytorch'``. On a machine without CUDA the N processes train on the CPU with gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys

from memfit.errors import ConfigError

# The launch flags of ``memfit train`` (consumed here, not passed on to the children).
LAUNCH_FLAGS = ("--gpus", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint")


def strip_launch_flags(argv: list[str]) -> list[str]:
    """``argv`` without the launch flags and their values (both ``--flag v`` and ``--flag=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def torchrun_command(train_argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str = "127.0.0.1", master_port: int = 29500,
                     rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun command line running ``memfit <train_argv>`` on ``nproc`` processes per node.

    With ``rdzv_endpoint`` (``host:port``) the nodes meet through the c10d rendezvous (elastic, any
    node may start first, no node ranks needed); otherwise node ``node_rank`` of ``nnodes`` connects
    to ``master_addr:master_port``, which node 0 serves.
    """
    if nproc < 1:  # memfit train --gpus 0 would otherwise train in this one process
        raise ConfigError(f"--gpus {nproc}: give the number of processes per machine (at least 1)")
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes}: give the number of machines (at least 1)")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--nnodes {nnodes} --node-rank {node_rank}: node rank must be in [0, nnodes)")
    if not 0 < master_port < 65536:  # torchrun's own error is a traceback
        raise ConfigError(f"--master-port {master_port}: give a free TCP port of node 0, 1 to 65535 (default 29500)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return [*cmd, "-m", "memfit", *train_argv]


# A preempted child touches this file (memfit.cli): torchrun itself exits 1 whatever its children's status.
PREEMPTED_FILE_ENV = "MEMFIT_PREEMPTED_FILE"


def spawn(argv: list[str], nproc: int, **kwargs: object) -> int:
    """Run ``memfit <argv>`` under torchrun (launch flags removed) and return its exit status: the children's
    preemption status (75) when they stopped on a preemption signal, which torchrun would report as 1."""
    import tempfile
    from pathlib import Path

    from memfit.errors import PREEMPTED_EXIT_CODE

    cmd = torchrun_command(strip_launch_flags(argv), nproc, **kwargs)  # type: ignore[arg-type]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, said explicitly
    with tempfile.TemporaryDirectory(prefix="memfit-") as tmp:
        marker = Path(tmp) / "preempted"
        env[PREEMPTED_FILE_ENV] = str(marker)
        code = subprocess.call(cmd, env=env)
        return PREEMPTED_EXIT_CODE if code != 0 and marker.exists() else code
