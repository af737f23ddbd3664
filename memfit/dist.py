"""Process-group helpers: rank, world size, collectives that are no-ops in a single process."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def default_device() -> torch.device:
    """The device this process trains on: its local CUDA device when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(launcher: str, backend: str | None = None, timeout_s: int | None = None) -> None:
    """Join the process group described by the launcher's environment (torchrun or Slurm).

    The backend follows the device (nccl on CUDA, gloo on CPU) unless ``backend`` names one.
    """
    if is_distributed() or launcher == "none":
        return
    if launcher == "slurm":
        _env_from_slurm()
    elif launcher != "pytorch":
        raise ValueError(f"unknown launcher {launcher!r}: use 'none', 'pytorch' or 'slurm'")
    if "RANK" not in os.environ:
        raise RuntimeError(
            f"launcher={launcher!r} but RANK/WORLD_SIZE are not set: start with torchrun "
            "(torchrun --nproc-per-node N -m memfit train CFG) or use launcher='none'"
        )
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout_s:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(**kwargs)
    _destroy_at_exit_once()


_joined = False  # this process joined a process group through memfit


def _destroy_at_exit_once() -> None:
    global _joined
    _joined = True
    atexit.unregister(_destroy_at_exit)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Destroy the group memfit joined while the interpreter is still whole, as torch's docs ask of every trainer
    process. It does not stop gloo's worker threads while anything still holds the group: a process that must
    not be aborted by them at exit ends through :func:`exit_process`."""
    if is_distributed():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``; one that joined a process group ends without the interpreter's
    finalization.

    destroy_process_group does not join gloo's worker threads while anything still holds the group, and
    a worker that drops a finished collective's tensors needs the GIL: under Python < 3.14 one that asks for
    it once finalization has begun is ended by pthread_exit inside a C++ destructor, which aborts the process
    (SIGABRT, "terminate called without an active exception") after training finished, when the machine is
    busy. So everything finalization would do that matters is done here, while the interpreter is whole:
    other threads joined, atexit handlers run (the group destroyed, logs flushed), unreachable objects
    collected (open files closed), standard streams flushed; then ``os._exit``.
    """
    if not (_joined or is_distributed()):
        sys.exit(code)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, closed or gone: nothing left to lose
            pass
    os._exit(code)


def resolve_launcher(launcher: str | None) -> str:
    """The launcher a Runner uses: ``None`` is inferred from the environment as MMEngine does (torchrun's
    RANK/WORLD_SIZE -> 'pytorch', a Slurm job of several tasks -> 'slurm', else 'none'). An explicit
    'none' in a process that is one of several is refused: two processes never train separately
    into one work dir."""
    from memfit.errors import ConfigError

    env = os.environ
    if launcher is None:
        if "RANK" in env and "WORLD_SIZE" in env:
            return "pytorch"
        # srun sets the step's task count; a batch script's own shell (one process) does not.
        if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
            return "slurm"
        return "none"
    if launcher not in ("none", "pytorch", "slurm"):
        raise ConfigError(f"launcher={launcher!r}: use 'none', 'pytorch' or 'slurm' (or leave it unset: inferred)")
    world = int(env.get("WORLD_SIZE") or 1)
    if launcher == "none" and world > 1 and not is_distributed():
        raise ConfigError(f"launcher='none' but this process is one of WORLD_SIZE={world}: they would train "
                          "separately into one work dir; use launcher='pytorch' or leave launcher unset (inferred)")
    return launcher


def launcher_from_env(launcher: str) -> str:
    """'pytorch' when torchrun's variables are set but the launcher was left at 'none' (the Python
    snippets of MMEngine's guides build a Runner without ``launcher=``); otherwise ``launcher`` unchanged."""
    if launcher == "none" and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "pytorch"
    return launcher


def ensure_process_group(dist_cfg: dict | None = None) -> None:
    """Join a one-process group when none exists, so DDP/FSDP/ZeRO code also runs unlaunched.

    Uses an in-memory store (no port, no environment variables); the backend follows the device.
    """
    if is_distributed():
        return
    backend = (dist_cfg or {}).get("backend") or ("nccl" if default_device().type == "cuda" else "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _destroy_at_exit_once()


def free_port() -> int:
    """A free TCP port on the loopback interface (for one-machine process groups)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_with_group(launcher: str) -> str:
    """The launcher for backends that always need a process group (DeepSpeed, ColossalAI): under
    torchrun with ``launcher='none'`` (as the FlexibleRunner scripts of MMEngine's large-model training
    guide run) join torchrun's group; alone, make a one-process group on a free local port."""
    if launcher != "none" or is_distributed():
        return launcher
    if "RANK" not in os.environ:
        port = free_port()
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            os.environ.setdefault(key, value)
    return "pytorch"


def _env_from_slurm() -> None:
    """Fill torchrun's variables from Slurm's (one task per GPU)."""
    env = os.environ
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in env:
        import subprocess

        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1")
        first = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=False
        ).stdout.split()
        env["MASTER_ADDR"] = first[0] if first else "127.0.0.1"
    env.setdefault("MASTER_PORT", "29500")


def all_gather_object(obj: Any) -> list[Any]:
    """Gather a picklable object from every rank (a one-element list in a single process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (for logging); the input itself is left unchanged."""
    if not is_distributed():
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / get_world_size()


_cpu_group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)


def cpu_group() -> Any:
    """A gloo group over every rank, for small host-side collectives that must not touch the GPU (no
    device synchronisation, no NCCL kernel): the default group itself when it is gloo (returned as None),
    else a gloo group created once per process group. Creating it is a collective: call it on every rank
    at the same point."""
    global _cpu_group
    if not is_distributed() or dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if _cpu_group is None or _cpu_group[0] is not world:
        _cpu_group = (world, dist.new_group(backend="gloo"))
    return _cpu_group[1]


def all_reduce_max_int(value: int, group: Any = None) -> int:
    """The largest ``value`` over all ranks, through a CPU tensor (on ``group``, e.g. :func:`cpu_group`);
    ``value`` itself in a single process."""
    if get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
