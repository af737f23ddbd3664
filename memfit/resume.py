"""What a checkpoint holds and how a run is put back exactly where it stopped.

The state is plain data and tensors only (loaded with ``weights_only=True``): model and optimizer
state dicts, scheduler states, the loop position, the sampler's consumed-sample count, RNG states of
every rank, the message hub, gradients of an unfinished accumulation window, and meta.
:class:`RunnerCheckpoints` gives the runner its ``save_checkpoint``, ``resume`` and ``load_weights``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from memfit import dist
from memfit._version import __version__
from memfit.errors import CheckpointError, ConfigError, did_you_mean, first_line
from memfit.optim.scheduler import load_scheduler_state, scheduler_state

logger = logging.getLogger("memfit")


def resume_path(resume: bool | str | None, work_dir: Path) -> Path | None:
    """``resume=True``: the newest intact checkpoint in work_dir (None if there is none; a damaged newer one
    is skipped with a warning); a path: that checkpoint, refused when damaged, or the newest intact
    checkpoint of the work dir it names. Rank 0 decides and every rank gets its answer
    (:func:`memfit.checkpoint.intact.agreed`)."""
    from memfit.checkpoint.intact import agreed, choose_checkpoint, choose_named

    if not resume:
        return None
    if resume is True or resume == "auto":
        from memfit.checkpoint.directory import recover

        if dist.is_main_process():  # a save a kill interrupted: put the previous checkpoint back in place
            recover(work_dir)
        dist.barrier()
        path = agreed(choose_checkpoint, work_dir)
        if path is None:
            logger.info(f"resume=True: no checkpoint in {work_dir} yet, training starts from the beginning")
        return path
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume={str(resume)!r}: no such checkpoint file")
    return agreed(choose_named, path)


# load_from=dict(path=..., **LOAD_FROM_OPTIONS): what memfit.checkpoint.load_weights accepts.
LOAD_FROM_OPTIONS = ("strict", "prefix", "revise_keys", "key_map", "map_location")


def load_from_options(load_from: str | Path | dict, **defaults: Any) -> tuple[str, dict]:
    """Split ``load_from`` (a path, or ``dict(path=..., strict=..., prefix=..., revise_keys=...,
    key_map=...)``) into the path and the keyword arguments of ``load_weights``; the dict's
    entries override ``defaults``. An unknown key is a ConfigError naming the nearest valid one."""
    if isinstance(load_from, str | Path):
        return str(load_from), defaults
    if not isinstance(load_from, dict) or "path" not in load_from:
        raise ConfigError(f"load_from={load_from!r}: give a path, or dict(path=..., strict=False, prefix=...)")
    options = {k: v for k, v in load_from.items() if k != "path"}
    for key in options:
        if key not in LOAD_FROM_OPTIONS:
            raise ConfigError(f"load_from: unknown key {key!r}: {did_you_mean(key, LOAD_FROM_OPTIONS)}")
    revise = options.get("revise_keys")
    if revise is not None:  # configs written as YAML/Python give lists of lists
        options["revise_keys"] = [tuple(pair) for pair in revise]
    return str(load_from["path"]), {**defaults, **options}


def _sampler(runner: Any) -> Any:
    loop = runner.train_loop
    return loop.sampler if loop is not None and hasattr(loop.sampler, "state_dict") else None


def _named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in sorted(model.named_parameters()) if p.grad is not None}


def optimizer_name(wrapper: Any) -> str:
    """The class name of the wrapper's optimizer; ZeRO-1's wrapper reports the optimizer it shards
    (AdamW, ...), so a ZeRO checkpoint resumes on one device or without ZeRO and vice versa; an offloaded
    optimizer likewise reports the one it runs on the host. Several optimizers (an OptimWrapperDict):
    ``name=Class`` pairs."""
    if hasattr(wrapper, "optim_wrappers"):
        return ",".join(f"{n}={optimizer_name(w)}" for n, w in wrapper.items())
    optimizer = getattr(wrapper.optimizer, "host_optimizer", wrapper.optimizer)
    inner = getattr(optimizer, "_optim_constructor", None)
    return getattr(inner, "__name__", None) or type(optimizer).__name__


def collect_state(runner: Any, meta: dict, *, save_optimizer: bool = True, save_param_scheduler: bool = True) -> dict:
    """Everything a resume needs, as tensors and plain data.

    Model and optimizer state go through the strategy (a sharded strategy returns its shards). With
    ``save_optimizer=False`` / ``save_param_scheduler=False`` (CheckpointHook options) those parts
    are left out; a resume then starts them afresh.
    """
    from memfit.checkpoint import capture_rng_state, to_plain

    model = runner.model
    wrapper = runner.optim_wrapper
    loop = runner.train_loop
    state: dict[str, Any] = {
        "meta": {
            "memfit_version": __version__,
            "torch_version": str(torch.__version__),
            "world_size": dist.get_world_size(),
            "seed": runner.seed,
            "optimizer": optimizer_name(wrapper) if wrapper is not None else None,
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
        if save_optimizer:
            state["optim_wrapper"] = runner.strategy.optim_state_dict(runner.model, wrapper)
        if save_param_scheduler:
            state["param_schedulers"] = scheduler_state(runner.param_schedulers)
        if save_optimizer and wrapper.inner_count % wrapper.accumulative_counts != 0:
            # Saved inside an accumulation window: keep the partial gradients so the window completes
            # exactly as it would have. Per rank: before the window's last micro-step each rank holds
            # only its own (unsynchronised) sum.
            state["grads"] = dist.all_gather_object(_named_grads(model))
    return state


def restore_state(runner: Any, state: dict, path: str | Path) -> None:
    """Load ``state`` into the runner; errors name the file and what does not fit."""
    from memfit.checkpoint import restore_rng_state
    from memfit.checkpoint.mmengine import from_mmengine, is_mmengine_checkpoint

    path = Path(path)
    if is_mmengine_checkpoint(state):  # written by MMEngine: its layout mapped onto memfit's
        loop = runner.train_loop
        state = from_mmengine(state, path, runner.model, runner.optim_wrapper, by_epoch=loop is None or loop.by_epoch,
                              iters_per_epoch=loop.iters_per_epoch if loop is not None else 1)
        runner.logger.info(f"{path}: an MMEngine {state['meta']['mmengine_version']} checkpoint, resumed at "
                           f"epoch {state['loop']['epoch']}, iteration {state['loop']['iter']}")
    for key in ("meta", "state_dict"):
        if key not in state:
            raise CheckpointError(f"{path}: not a memfit training checkpoint (no {key!r}); use load_from for weights")
    model = runner.model
    try:
        runner.strategy.load_model_state_dict(runner.model, state["state_dict"], strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[1:3]) or first[0]
        raise CheckpointError(f"{path}: does not fit the model: {detail}") from None
    wrapper = runner.optim_wrapper
    if wrapper is not None:
        _restore_optimization(runner, model, wrapper, state, path)
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


def _restore_optimization(runner: Any, model: torch.nn.Module, wrapper: Any, state: dict, path: Path) -> None:
    """Optimizer (through the strategy), schedulers and an open accumulation window's gradients."""
    if "optim_wrapper" not in state:
        runner.logger.warning(f"{path}: holds no optimizer state (saved with save_optimizer=False): "
                              "the optimizer starts afresh")
    else:
        saved, built = state["meta"].get("optimizer"), optimizer_name(wrapper)
        if saved and saved != built:
            raise CheckpointError(
                f"{path}: saved with optimizer {saved}, the config builds {built}: "
                "resume with the same optimizer, or start from the weights with load_from"
            )
        try:
            runner.strategy.load_optim_state_dict(runner.model, wrapper, state["optim_wrapper"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit: {first_line(exc)}") from None
    load_scheduler_state(runner, state, path)
    grads = state.get("grads") or []
    if grads:
        own = grads[dist.get_rank()] if len(grads) == dist.get_world_size() else _mean_grads(grads)
        if len(grads) != dist.get_world_size():
            runner.logger.warning(f"{path}: saved inside an accumulation window at world size {len(grads)}, resumed "
                                  f"at {dist.get_world_size()}: every rank starts from the mean of the saved ranks' "
                                  "partial gradients (the same window as before when the global batch is the same)")
        for name, p in model.named_parameters():
            if name in own:
                p.grad = own[name].to(p.device, p.dtype)


def _mean_grads(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of every rank's partial gradient. After the window's all-reduce (a mean over ranks) each rank
    then holds what the saved ranks would have: the saved part's mean plus the mean of the new ranks' parts."""
    names = set.intersection(*(set(g) for g in grads))
    return {n: torch.stack([g[n].float() for g in grads]).mean(0).to(grads[0][n].dtype) for n in sorted(names)}


class RunnerCheckpoints:
    """The runner's checkpoint methods, by MMEngine's names: ``load_weights`` (``load_from``),
    ``save_checkpoint`` and ``resume``, over :func:`collect_state` and :func:`restore_state` above."""

    def _load_or_resume(self) -> None:
        path = resume_path(self.resume_from, self.work_dir)
        if path is not None:
            self.resume(path)
        elif self.load_from:
            self.load_weights(self.load_from)

    def load_weights(self, path: str | dict, strict: bool = True, **kwargs: Any) -> tuple[list[str], list[str]]:
        """``load_from``: model weights only (memfit checkpoint, state dict, .safetensors, or a work dir's last).

        ``path`` may be ``dict(path=..., strict=..., prefix=..., revise_keys=..., key_map=...)`` (the
        config form); returns the (missing, unexpected) keys, which are also logged.
        """
        from memfit.checkpoint import resolve_checkpoint

        path, options = load_from_options(path, strict=strict, **kwargs)
        path = str(resolve_checkpoint(path))  # a work dir: its last checkpoint
        missing, unexpected = self.strategy.load_weights(self.model, path, **options)
        self.logger.info(f"Loaded weights from {path}")
        return missing, unexpected

    def save_checkpoint(self, filename: str, *, meta: dict | None = None, save_optimizer: bool = True,
                        save_param_scheduler: bool = True) -> Path:
        """Write the full training state to ``work_dir/filename`` (atomic) and point last_checkpoint at it."""
        from memfit.checkpoint import write_latest

        state = collect_state(self, meta or {}, save_optimizer=save_optimizer,
                              save_param_scheduler=save_param_scheduler)
        self.call_hook("before_save_checkpoint", checkpoint=state)
        path = self.work_dir / filename
        complete = self.strategy.save_checkpoint(path, state)
        if complete is not False and dist.is_main_process():  # False: an async write, finalized later
            write_latest(self.work_dir, filename)
        return path

    def resume(self, path: str | Path) -> None:
        """Restore everything ``save_checkpoint`` wrote and continue at the next unseen batch (``path``: a
        checkpoint, or a work dir for its last)."""
        from memfit.checkpoint import resolve_checkpoint

        path = resolve_checkpoint(path)
        state = self.strategy.load_checkpoint(path)
        restore_state(self, state, path)
        self.call_hook("after_load_checkpoint", checkpoint=state)
        self.logger.info(f"Resumed from {path} at epoch {self.epoch + 1}, iteration {self.iter}")
