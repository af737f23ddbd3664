"""DeepSpeedStrategy: ZeRO 0-3 and CPU offload through a DeepSpeed engine, precision kept as its own axis.

The config of MMEngine's large-model training guide is accepted as written (``fp16=dict(...)``, ``bf16=dict(...)``,
``inputs_to_half=[0]``, ``zero_optimization=dict(stage=3, offload_optimizer=..., cpu_offload=...)``,
``gradient_clipping=...`` and any other DeepSpeed key). memfit fills in what it already knows, so
there is one source of truth: ``train_micro_batch_size_per_gpu`` from the train dataloader's
``batch_size``, ``gradient_accumulation_steps`` from ``optim_wrapper.accumulative_counts`` and
``gradient_clipping`` from ``optim_wrapper.clip_grad``.

Precision (chosen by :mod:`memfit.connector`): an :class:`AutocastPrecision` (``AmpOptimWrapper``,
``--amp``, Apex O1 ``amp``) becomes DeepSpeed's ``torch_autocast`` section:
parameters, master weights and the loss stay fp32 and only autocast-safe ops run in half (a
GradScaler for fp16), so memfit's fp32 islands still hold. DeepSpeed's whole-model ``fp16``/``bf16``
modes cast every parameter and the loss computed inside the model to half, like Apex O2: that is
why the DINO run of MMDetection's large-model example overflowed every step. They stay available when
asked for, with a warning.

Checkpoints are directory checkpoints (:mod:`memfit.checkpoint.directory`) whose shards
``engine.save_checkpoint`` writes (each rank its own ZeRO shard); ``memfit export`` consolidates
them with DeepSpeed's zero_to_fp32 (:mod:`memfit.checkpoint.deepspeed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.checkpoint.deepspeed import ENGINE_TAG, is_deepspeed_checkpoint, weights_only_loads
from memfit.checkpoint.directory import StateRef, read_extras, save_directory, split_state
from memfit.errors import CheckpointError, ConfigError, warn_ignored
from memfit.precision import APEX_OPT_LEVELS, AutocastPrecision, HalfPrecision, Precision, dtype_name, parse_dtype
from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities, shards_up_to
from memfit.strategies.deepspeed_config import check_deepspeed_config, deepspeed_config_error
from memfit.strategies.deepspeed_half import cast_inputs, keep_batchnorm_fp32
from memfit.strategies.route import route_forward

logger = logging.getLogger("memfit")

_HALF_WARNING = (
    "DeepSpeedStrategy {mode}=dict(enabled=True) casts the whole model, and the loss computed inside it, to "
    "{dtype} (like Apex O2): numerically sensitive ops (log/exp, small epsilons, large sums) can overflow or stall "
    "- the DINO run of MMDetection's large-model example overflowed every step this way. "
    "Prefer optim_wrapper=dict(type='AmpOptimWrapper', dtype=...) (DeepSpeed's torch_autocast: fp32 weights and "
    "losses) with the same ZeRO savings."
)


def import_deepspeed() -> Any:
    """Import deepspeed (the ``memfit[deepspeed]`` extra) with its shared-memory comm op switched off:
    that op serves only inference all-reduce and costs a one-minute JIT C++ build on a fresh CPU machine."""
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise ConfigError(f"DeepSpeedStrategy needs deepspeed: pip install 'memfit[deepspeed]' ({exc})") from None
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines drown memfit's log
    return deepspeed


@STRATEGIES.register()
class DeepSpeedStrategy(Strategy):
    """Train through ``deepspeed.initialize``; every keyword not named here is a DeepSpeed config key.

    ``config``: a DeepSpeed JSON file or dict the keywords update. ``inputs_to_half``: positions
    (or keys, for a dict batch) of the inputs cast to the model's dtype in whole-model fp16/bf16
    mode. ``bn_fp32``: in those modes, BatchNorm layers normalise in fp32 with fp32 running
    statistics (bf16 statistics lose most of their digits). ``exclude_frozen_parameters`` keeps
    frozen weights out of checkpoints.
    """

    def __init__(self, *, config: str | dict | None = None, zero_optimization: dict | None = None,
                 gradient_clipping: float | None = None, fp16: dict | None = None, bf16: dict | None = None,
                 amp: dict | None = None, torch_autocast: dict | None = None, inputs_to_half: list | None = None,
                 activation_checkpointing: dict | None = None, aio: dict | None = None,
                 train_micro_batch_size_per_gpu: int | None = None, gradient_accumulation_steps: int | None = None,
                 steps_per_print: int = 10**13, exclude_frozen_parameters: bool = False, bn_fp32: bool = True,
                 **kwargs: Any) -> None:
        super().__init__()
        base: dict[str, Any] = {}
        if isinstance(config, (str, os.PathLike)):
            import json

            base = json.loads(Path(config).read_text())
        elif isinstance(config, Mapping):
            base = dict(config)
        elif config is not None:
            raise ConfigError(f"strategy.config={config!r}: give a DeepSpeed JSON path or a dict")
        given = dict(zero_optimization=zero_optimization, gradient_clipping=gradient_clipping, fp16=fp16, bf16=bf16,
                     amp=amp, torch_autocast=torch_autocast, activation_checkpointing=activation_checkpointing,
                     aio=aio, train_micro_batch_size_per_gpu=train_micro_batch_size_per_gpu,
                     gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)
        self.ds_config: dict[str, Any] = {**base, **{k: v for k, v in given.items() if v is not None}}
        self.ds_config.setdefault("steps_per_print", steps_per_print)
        if self.ds_config.get("activation_checkpointing"):  # passed on, but deepspeed.initialize applies none
            warn_ignored("DeepSpeedStrategy.activation_checkpointing", "DeepSpeed checkpoints only code that calls "
                         "deepspeed.checkpointing.checkpoint itself; use cfg=dict(activation_checkpointing=[...])")
        self.inputs_to_half = list(inputs_to_half) if inputs_to_half is not None else None
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.bn_fp32 = bn_fp32
        self.micro_batch_size: int | None = None
        self.engine: Any = None

    @property
    def capabilities(self) -> Capabilities:
        """ZeRO's stage says what is sharded; the engine owns the optimizer, its offload and the forward, and
        flattens the parameters into contiguous buffers. Its engine does not run on fake tensors."""
        zero = self.ds_config.get("zero_optimization")
        zero = zero if isinstance(zero, Mapping) else {}
        param_offload = zero.get("offload_param")
        offloads = isinstance(param_offload, Mapping) and param_offload.get("device", "none") != "none"
        return Capabilities(shards=shards_up_to(int(zero.get("stage", 0) or 0)), data_parallel=True,
                            offloads_parameters=offloads, own_optimizer=True,
                            own_offload="zero_optimization=dict(offload_optimizer=dict(device='cpu'))",
                            contiguous_parameters=True, fake_step=False,
                            optim_wrappers=frozenset({"DeepSpeedOptimWrapper"}),
                            config_hint="strategy=dict(type='DeepSpeedStrategy', ...)", sharded_checkpoints=True,
                            partial_gradients=False)

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """DeepSpeed always needs a process group: join torchrun's (also when ``launcher='none'``, as
        the FlexibleRunner scripts of MMEngine's large-model training guide run it) or make a one-process group."""
        import_deepspeed()
        check_deepspeed_config(self.ds_config)  # DeepSpeed's own validation, before anything is built
        super().setup_env(dist.launcher_with_group(launcher), env_cfg)
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)

    def set_micro_batch_size(self, batch_size: int | None) -> None:
        self.micro_batch_size = batch_size

    # -- precision ---------------------------------------------------------------------------
    def precision_request(self) -> Precision | None:
        """What this strategy's own DeepSpeed keys ask for: ``fp16``/``bf16`` (whole-model half),
        ``amp`` (Apex O1: autocast) or ``torch_autocast``."""
        half = [mode for mode in ("fp16", "bf16") if (self.ds_config.get(mode) or {}).get("enabled", False)]
        if len(half) > 1:
            raise ConfigError("strategy fp16 and bf16 are both enabled: enable one")
        if half:
            return HalfPrecision(torch.float16 if half[0] == "fp16" else torch.bfloat16)
        apex = self.ds_config.get("amp") or {}
        if apex and apex.get("enabled", True):
            level = apex.get("opt_level", "O1")
            logger.info(f"DeepSpeedStrategy amp (Apex {level}) runs as torch autocast")
            return AutocastPrecision(parse_dtype(APEX_OPT_LEVELS.get(level, "float16")))
        user = self.ds_config.get("torch_autocast") or {}
        if user.get("enabled"):
            return AutocastPrecision(parse_dtype(user.get("dtype", "bfloat16"), "strategy.torch_autocast.dtype"))
        return None

    def check_precision(self, precision: Precision) -> None:
        from deepspeed.accelerator import get_accelerator

        self.refuse_master_weights(precision, "strategy bf16=dict(enabled=True) or fp16=dict(enabled=True) "
                                              "(DeepSpeed's fp32 masters) or precision=dict(opt_level='O1') (autocast)")

        if isinstance(precision, HalfPrecision):
            if precision.dtype is torch.float16 and not get_accelerator().is_fp16_supported():
                raise ConfigError(f"strategy fp16=dict(enabled=True): DeepSpeed's {get_accelerator().device_name()} "
                                  "accelerator has no fp16 mode; use bf16=dict(enabled=True) or, better, "
                                  "optim_wrapper=dict(type='AmpOptimWrapper') (torch autocast)")
            logger.warning(_HALF_WARNING.format(mode=precision.name[:4].replace("-", ""),
                                                dtype=dtype_name(precision.dtype)))
        elif (isinstance(precision, AutocastPrecision) and precision.dtype is torch.float16
              and precision.loss_scale != "dynamic"):  # bf16 scales nothing: amp_precision warned
            raise ConfigError(f"optim_wrapper.loss_scale={precision.loss_scale!r}: DeepSpeed's torch_autocast uses a "
                              "dynamic GradScaler; remove loss_scale")

    # -- building the engine -----------------------------------------------------------------
    def setup(self, model: nn.Module, optim_wrapper: Any) -> None:
        """Build the DeepSpeed config from memfit's settings and hand the model and the wrapper's torch
        optimizer to ``deepspeed.initialize``; the model's forward then runs through the engine."""
        import deepspeed
        import pydantic

        counts = optim_wrapper.accumulative_counts if optim_wrapper is not None else 1
        clip = optim_wrapper.clip_grad if optim_wrapper is not None else None
        if clip and clip.get("norm_type", 2) not in (2, 2.0):
            raise ConfigError(f"optim_wrapper.clip_grad={clip!r}: DeepSpeed clips by the L2 norm only (norm_type=2)")
        config = self.build_config(counts, clip)
        optimizer = optim_wrapper.optimizer if optim_wrapper is not None else None
        try:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
        except pydantic.ValidationError as exc:  # a key memfit filled in: still one line naming it
            raise deepspeed_config_error(exc) from exc
        if self.half_dtype is not None and self.bn_fp32:
            keep_batchnorm_fp32(self.engine.module)
        route_forward(model, self.engine, prepare=self._cast_call)

    def _cast_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``inputs_to_half`` on a forward call: positions index the positional inputs, names the keyword ones."""
        which, dtype = self.inputs_to_half, self.half_dtype
        if not which or dtype is None:
            return args, kwargs
        positions = [w for w in which if isinstance(w, int)]
        names = [w for w in which if not isinstance(w, int)]
        return (cast_inputs(args, positions, dtype) if positions else args,
                cast_inputs(kwargs, names, dtype) if names else kwargs)

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The parameters' dtype in whole-model fp16/bf16 mode, else None."""
        return self.precision.dtype if isinstance(self.precision, HalfPrecision) else None

    def build_config(self, accumulative_counts: int = 1, clip_grad: dict | None = None) -> dict[str, Any]:
        """The DeepSpeed config dict: the user's keys plus what memfit owns (batch, accumulation,
        clipping, precision). A value given in both places must agree."""
        config = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.ds_config.items()}
        micro = self.micro_batch_size or 1  # evaluation only: DeepSpeed still wants a number
        _owned(config, "train_micro_batch_size_per_gpu", micro, "train_dataloader.batch_size")
        _owned(config, "gradient_accumulation_steps", accumulative_counts, "optim_wrapper.accumulative_counts")
        _owned(config, "train_batch_size", micro * accumulative_counts * dist.get_world_size(),
               "batch_size x accumulative_counts x world size")
        if clip_grad:
            _owned(config, "gradient_clipping", float(clip_grad["max_norm"]), "optim_wrapper.clip_grad.max_norm")
        else:  # DeepSpeed clips at 1.0 unless told otherwise; unset clip_grad means no clipping, as elsewhere
            config.setdefault("gradient_clipping", 0.0)
        # A torch optimizer under ZeRO-Offload: DeepSpeed would otherwise insist on its C++ CPUAdam.
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        # Any torch optimizer (SGD, LARC, ...) works under ZeRO's partitioning; DeepSpeed only vouches for Adam.
        config.setdefault("zero_allow_untested_optimizer", True)
        zero = config.get("zero_optimization")
        if isinstance(zero, Mapping):
            config["zero_optimization"] = zero = dict(zero)
            for key in ("offload_optimizer", "offload_param"):
                if isinstance(zero.get(key), Mapping) and self.device.type == "cpu":
                    zero[key] = {"pin_memory": False, **zero[key]}  # no pinned memory without a GPU
        config.pop("amp", None)  # DeepSpeed removed its Apex integration: Apex O1 is torch autocast here
        if isinstance(self.precision, AutocastPrecision):
            # DeepSpeed reduces the gradients of Linear/Conv weights in the autocast dtype by default; memfit
            # keeps torch AMP's semantics (fp32 gradients, exact against one process) unless the user lists
            # lower_precision_safe_modules to trade that for half the gradient traffic.
            config["torch_autocast"] = {"lower_precision_safe_modules": [], **(config.get("torch_autocast") or {}),
                                        "enabled": True, "dtype": dtype_name(self.precision.dtype)}
        elif isinstance(self.precision, HalfPrecision):
            mode = "fp16" if self.precision.dtype is torch.float16 else "bf16"
            config[mode] = {**(config.get(mode) or {}), "enabled": True}
        if self.inputs_to_half and self.half_dtype is None:
            logger.info("DeepSpeedStrategy inputs_to_half is ignored: the model runs in fp32 (autocast casts "
                        "inside the ops that are safe in half)")
        return config

    # -- the step ----------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Nothing to enter: autocast runs inside the engine's forward (its ``torch_autocast`` section)."""
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module, sync: bool) -> Any:
        """DeepSpeed reduces gradients only at the boundary marked here, before the forward."""
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (it scales in its half modes). DeepSpeed's contract is a ``step()`` after
        every backward; off the window's boundary it only advances the engine's counters. The engine's
        own loss division is off (``scale_wrt_gas=False``): the wrapper divides by the real window size."""
        self.engine.backward(loss, scale_wrt_gas=False, **kwargs)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()

    def optimizer_step(self, optimizer: Any, clip_grad: dict | None = None, **kwargs: Any) -> torch.Tensor | None:
        """The engine reduces, clips (``gradient_clipping``, from clip_grad) and steps its ZeRO optimizer."""
        self.engine.step(**kwargs)
        if not clip_grad:
            return None
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    def zero_grad(self, optimizer: Any, **kwargs: Any) -> None:
        """The engine clears (or re-partitions) gradients after its own step."""

    def log_scalars(self) -> dict[str, Any]:
        if self.engine is not None and (self.engine.fp16_enabled() or self.engine.bfloat16_enabled()):
            return {"skipped_steps": torch.as_tensor(int(self.engine.skipped_steps))}
        return {}

    # -- state -------------------------------------------------------------------------------
    def load_weights(self, model: nn.Module, path: Any, **options: Any) -> Any:
        """``load_from`` under ZeRO: gather the partitioned parameters (stage 3), load, re-partition,
        and refresh the optimizer's fp32 master copy so the first step starts from the loaded weights."""
        import deepspeed

        from memfit.checkpoint import load_weights

        module = model
        gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0)
                  if self.engine.zero_optimization_partition_weights() else contextlib.nullcontext())
        with gather:
            result = load_weights(module, path, **options)
        if hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()
        return result

    def model_state_dict(self, model: nn.Module) -> Any:
        """A placeholder: the engine writes the (sharded) weights itself in ``save_checkpoint``."""
        return StateRef(None, "model")

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        return {**wrapper.checkpoint_state(with_optimizer=False), "optimizer": StateRef(None, "optimizer")}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on every rank (gathered under ZeRO-3; a collective)."""
        import deepspeed

        module = model
        if not self.engine.zero_optimization_partition_weights():
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def save_checkpoint(self, path: str | Path, state: dict) -> None:
        """The engine's shards and memfit's extras as one directory checkpoint, renamed into place
        (:mod:`memfit.checkpoint.directory`). Every rank must call this."""
        _, extras = split_state(state)
        save_directory(path, extras, lambda tmp: self.engine.save_checkpoint(
            str(tmp), tag=ENGINE_TAG, client_state={}, save_latest=False,
            exclude_frozen_parameters=self.exclude_frozen_parameters))

    def load_checkpoint(self, path: str | Path) -> dict:
        """Plain extras now; the engine loads its shards when ``restore_state`` reaches the model."""
        path = Path(path)
        if not is_deepspeed_checkpoint(path):
            raise CheckpointError(f"{path}: not a DeepSpeed checkpoint directory; a DeepSpeed run resumes from its "
                                  "own checkpoints. To start from these weights use load_from (weights only)")
        state = read_extras(path)
        saved = state.get("meta", {}).get("world_size")
        if saved is not None and saved != dist.get_world_size():
            raise CheckpointError(
                f"{path}: saved by {saved} ranks, this run has {dist.get_world_size()}: DeepSpeed's ZeRO shards "
                f"load at the world size that wrote them. Export the weights (memfit export {path} "
                f"model.safetensors) and start from them with load_from, or convert the shards with DeepSpeed's "
                f"universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {path / ENGINE_TAG} ...)"
            )
        state["state_dict"] = StateRef(path, "model")
        if "optim_wrapper" in state:
            state["optim_wrapper"]["optimizer"] = StateRef(path, "optimizer")
        return state

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        if not isinstance(state, StateRef):  # a full state dict
            return self.load_weights(model, state, strict=strict)
        with weights_only_loads():
            load_path, _ = self.engine.load_checkpoint(str(state.path), tag=ENGINE_TAG, load_module_strict=strict,
                                                       load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"{state.path}: DeepSpeed found no checkpoint under tag {ENGINE_TAG!r}")
        return None

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        """The optimizer came back with the engine's shards; only the wrapper's counting is left."""
        wrapper.load_checkpoint_state({k: v for k, v in state.items() if k != "optimizer"})


def _owned(config: dict, key: str, value: Any, source: str) -> None:
    if key in config and config[key] != value:
        raise ConfigError(f"strategy.{key}={config[key]!r} disagrees with {source}={value!r}: memfit sets it from "
                          f"{source}; remove it from the strategy")
    config[key] = value


