"""Capture and restore every global random generator as plain data (python, numpy, torch, CUDA).

Resuming bit-exactly needs the generators that dropout, augmentation and shuffling draw from to
continue where they stopped. The states are stored as tensors, lists and numbers only, so they go
through ``torch.load(weights_only=True)``; each process (rank) captures its own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from memfit.errors import CheckpointError


def capture_rng_state() -> dict[str, Any]:
    """Return the states of python ``random``, numpy's legacy global generator, torch CPU and CUDA.

    ``cuda`` is present only when CUDA is available on this machine; numpy's 624-word
    Mersenne Twister key is stored as an int64 tensor (values are uint32).
    """
    version, py_state, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss_next},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng_state`.

    A missing ``cuda`` entry leaves CUDA generators alone (checkpoint written on a CPU machine);
    a different number of CUDA devices restores the devices both have, since a resume on another
    machine shape cannot be bit-exact anyway.
    """
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        npy = state["numpy"]
        np.random.set_state(
            (
                npy["name"],
                npy["keys"].numpy().astype(np.uint32),
                npy["pos"],
                npy["has_gauss"],
                npy["cached_gaussian"],
            )
        )
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint RNG state is malformed ({type(exc).__name__}: {exc})") from exc
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        for device, cuda_state in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(cuda_state, device)
