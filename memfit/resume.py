"""What a checkpoint holds and how a run is put back exactly where it stopped.

The state is plain data and tensors only (loaded with ``weights_only=True``): model and optimizer
state dicts, scheduler states, the loop position, the sampler's consumed-sample count, RNG states of
every rank, the message hub, gradients of an unfinished accumulation window, and meta.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memfit import __version__, dist
from memfit.errors import CheckpointError


def resume_path(resume: bool | str | None, work_dir: Path) -> Path | None:
    """``resume=True``: the latest checkpoint in work_dir (None if there is none); a path: that file."""
    from memfit.checkpoint import read_latest

    if not resume:
        return None
    if resume is True or resume == "auto":
        return read_latest(work_dir)
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume={str(resume)!r}: no such checkpoint file")
    return path


def _sampler(runner: Any) -> Any:
    loop = runner.train_loop
    return loop.sampler if loop is not None and hasattr(loop.sampler, "state_dict") else None


def _named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in sorted(model.named_parameters()) if p.grad is not None}


def collect_state(runner: Any, meta: dict) -> dict:
    """Everything a resume needs, as tensors and plain data."""
    from memfit.checkpoint import capture_rng_state, to_plain

    model = runner.strategy.unwrap(runner.model)
    wrapper = runner.optim_wrapper
    loop = runner.train_loop
    state: dict[str, Any] = {
        "meta": {
            "memfit_version": __version__,
            "torch_version": str(torch.__version__),
            "world_size": dist.get_world_size(),
            "seed": runner.seed,
            "optimizer": type(wrapper.optimizer).__name__ if wrapper is not None else None,
            "cfg": to_plain(runner._cfg_to_dump) if runner._cfg_to_dump is not None else None,
            **to_plain(meta),
        },
        "state_dict": runner.strategy.model_state_dict(runner.model),
        "message_hub": to_plain(runner.message_hub.state_dict()),
        # Every rank's RNG, so a resume at the same world size restores each rank's stream.
        "rng": dist.all_gather_object(capture_rng_state()),
    }
    if loop is not None:
        state["loop"] = loop.state_dict()
        sampler = _sampler(runner)
        if sampler is not None:
            state["sampler"] = sampler.state_dict()
    if wrapper is not None:
        state["optim_wrapper"] = wrapper.state_dict()
        state["param_schedulers"] = [s.state_dict() for s in runner.param_schedulers]
        if wrapper.inner_count % wrapper.accumulative_counts != 0:
            # Saved inside an accumulation window: keep the partial gradients so the window completes
            # exactly as it would have.
            state["grads"] = _named_grads(model)
    return state


def restore_state(runner: Any, state: dict, path: str | Path) -> None:
    """Load ``state`` into the runner; errors name the file and what does not fit."""
    from memfit.checkpoint import restore_rng_state

    path = Path(path)
    for key in ("meta", "state_dict"):
        if key not in state:
            raise CheckpointError(f"{path}: not a memfit training checkpoint (no {key!r}); use load_from for weights")
    model = runner.strategy.unwrap(runner.model)
    try:
        runner.strategy.load_model_state_dict(runner.model, state["state_dict"], strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[1:3]) or first[0]
        raise CheckpointError(f"{path}: does not fit the model: {detail}") from None
    wrapper = runner.optim_wrapper
    if wrapper is not None and "optim_wrapper" in state:
        saved = state["meta"].get("optimizer")
        if saved and saved != type(wrapper.optimizer).__name__:
            raise CheckpointError(
                f"{path}: saved with optimizer {saved}, the config builds {type(wrapper.optimizer).__name__}: "
                "resume with the same optimizer, or start from the weights with load_from"
            )
        try:
            wrapper.load_state_dict(state["optim_wrapper"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit: {exc}") from None
        saved_scheds = state.get("param_schedulers", [])
        if len(saved_scheds) != len(runner.param_schedulers):
            raise CheckpointError(
                f"{path}: holds {len(saved_scheds)} param schedulers, the config has {len(runner.param_schedulers)}"
            )
        for sched, s in zip(runner.param_schedulers, saved_scheds):
            sched.load_state_dict(s)
        grads = state.get("grads") or {}
        for name, p in model.named_parameters():
            if name in grads:
                p.grad = grads[name].to(p.device, p.dtype)
    if runner.train_loop is not None and "loop" in state:
        runner.train_loop.load_state_dict(state["loop"])
        sampler = _sampler(runner)
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
    runner.message_hub.load_state_dict(state.get("message_hub", {}))
    rngs = state.get("rng") or []
    if len(rngs) == dist.get_world_size():
        restore_rng_state(rngs[dist.get_rank()])
    elif rngs:
        restore_rng_state(rngs[0])
        runner.logger.warning(f"{path}: saved at world size {len(rngs)}; RNG streams of rank 0 used on every rank")
