"""DeepSpeedStrategy: ZeRO 0-3 and CPU offload through a DeepSpeed engine, precision kept as its own axis.

The seeds' config is accepted as written (``fp16=dict(...)``, ``bf16=dict(...)``,
``inputs_to_half=[0]``, ``zero_optimization=dict(stage=3, offload_optimizer=..., cpu_offload=...)``,
``gradient_clipping=...`` and any other DeepSpeed key). memfit fills in what it already knows, so
there is one source of truth: ``train_micro_batch_size_per_gpu`` from the train dataloader's
``batch_size``, ``gradient_accumulation_steps`` from ``optim_wrapper.accumulative_counts`` and
``gradient_clipping`` from ``optim_wrapper.clip_grad``.

Precision: an ``AmpOptimWrapper`` (``--amp``) becomes DeepSpeed's ``torch_autocast`` section:
parameters, master weights and the loss stay fp32 and only autocast-safe ops run in half (a
GradScaler for fp16), so memfit's fp32 islands still hold. DeepSpeed's whole-model ``fp16``/``bf16``
modes cast every parameter and the loss computed inside the model to half, like Apex O2: that is
why the seed's DINO run overflowed every step. They stay available when asked for, with a warning.

Checkpoints are directories written by ``engine.save_checkpoint`` (each rank its own ZeRO shard)
plus memfit's plain extras (loop position, sampler, RNG, schedulers) in ``memfit_state.pth``,
renamed into place atomically. ``memfit export`` consolidates them with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit import dist
from memfit.checkpoint.io import fsync_dir
from memfit.errors import CheckpointError, ConfigError
from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.wrapped import StepThroughWrapper

logger = logging.getLogger("memfit")

ENGINE_TAG = "engine"  # DeepSpeed's "tag" sub-directory inside a memfit checkpoint directory
EXTRAS_FILE = "memfit_state.pth"
_WRAPPERS = ("DeepSpeedOptimWrapper", "OptimWrapper", "AmpOptimWrapper")
_HALF_WARNING = (
    "DeepSpeedStrategy {mode}=dict(enabled=True) casts the whole model, and the loss computed inside it, to "
    "{dtype} (like Apex O2): numerically sensitive ops (log/exp, small epsilons, large sums) can overflow or stall "
    "- the seed's DINO run overflowed every step this way. Prefer optim_wrapper=dict(type='AmpOptimWrapper', "
    "dtype=...) (DeepSpeed's torch_autocast: fp32 weights and losses) with the same ZeRO savings."
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
        self.inputs_to_half = list(inputs_to_half) if inputs_to_half is not None else None
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.bn_fp32 = bn_fp32
        self.micro_batch_size: int | None = None
        self.engine: Any = None
        self.half_dtype: torch.dtype | None = None  # set in whole-model fp16/bf16 mode

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """DeepSpeed always needs a process group: join torchrun's (also when ``launcher='none'``, as
        the seeds' FlexibleRunner scripts run it) or make a one-process group."""
        import_deepspeed()
        super().setup_env(dist.launcher_with_group(launcher), env_cfg)
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)

    def set_micro_batch_size(self, batch_size: int | None) -> None:
        self.micro_batch_size = batch_size

    # -- building the engine -----------------------------------------------------------------
    def prepare(self, model: nn.Module, optim_wrapper: Any = None,
                transforms: Callable[[nn.Module], None] | None = None,
                optimizer_in_backward: bool = False) -> tuple[nn.Module, Any]:
        """Apply memory ``transforms``, build the torch optimizer and the DeepSpeed config from memfit's
        settings, and hand both to ``deepspeed.initialize``."""
        import deepspeed

        from memfit.optim.builder import build_optimizer
        from memfit.optim.deepspeed import DeepSpeedOptimWrapper

        if optimizer_in_backward:
            raise ConfigError("cfg.optimizer_in_backward does not combine with DeepSpeedStrategy (the engine steps "
                              "its ZeRO optimizer): remove it")
        model = self.to_device(model)
        if transforms is not None:
            transforms(model)
        wrapper_kwargs, amp = self._wrapper_settings(optim_wrapper)
        config = self.build_config(wrapper_kwargs.get("accumulative_counts", 1), wrapper_kwargs.get("clip_grad"), amp)
        optimizer = None
        if optim_wrapper is not None:
            optimizer = build_optimizer(model, wrapper_kwargs.pop("optimizer"), wrapper_kwargs.pop("paramwise_cfg"))
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               dist_init_required=False)
        if self.half_dtype is not None and self.bn_fp32:
            keep_batchnorm_fp32(self.engine.module)
        wrapper = None
        if optimizer is not None:
            wrapper = DeepSpeedOptimWrapper(optimizer, **wrapper_kwargs)
            wrapper.bind(self, self.device)
            wrapper.attach(self.engine)
        cast = functools.partial(cast_inputs, which=self.inputs_to_half, dtype=self.half_dtype)
        return StepThroughWrapper(self.engine, self.engine.module, cast), wrapper

    def _wrapper_settings(self, cfg: Any) -> tuple[dict[str, Any], dict | None]:
        """Split an optim_wrapper config into DeepSpeedOptimWrapper kwargs and an autocast request."""
        if cfg is None:
            return {}, None
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"optim_wrapper must be a config dict under DeepSpeedStrategy (the engine builds the "
                              f"wrapper around its own optimizer), got {type(cfg).__name__}")
        cfg = dict(cfg)
        kind = cfg.pop("type", "DeepSpeedOptimWrapper")
        kind = getattr(kind, "__name__", kind)
        if kind not in _WRAPPERS:
            raise ConfigError(f"optim_wrapper.type={kind!r} under DeepSpeedStrategy: use one of {', '.join(_WRAPPERS)}")
        if "optimizer" not in cfg:
            raise ConfigError("optim_wrapper.optimizer is missing: e.g. optimizer=dict(type='AdamW', lr=1e-3)")
        amp = None
        if kind == "AmpOptimWrapper":
            from memfit.precision import default_amp_dtype, parse_dtype

            dtype = parse_dtype(cfg.pop("dtype", None), "optim_wrapper.dtype") or default_amp_dtype(self.device.type)
            loss_scale = cfg.pop("loss_scale", "dynamic")
            if loss_scale != "dynamic":
                raise ConfigError(f"optim_wrapper.loss_scale={loss_scale!r}: DeepSpeed's torch_autocast uses a dynamic "
                                  "GradScaler; remove loss_scale")
            cfg.pop("fp32_modules", None)  # applied as a memory transform before the engine is built
            cfg.pop("use_fsdp", None)
            amp = {"enabled": True, "dtype": str(dtype).removeprefix("torch.")}
        cfg.pop("constructor", None)
        kwargs = {"optimizer": cfg.pop("optimizer"), "paramwise_cfg": cfg.pop("paramwise_cfg", None),
                  "accumulative_counts": cfg.pop("accumulative_counts", 1), "clip_grad": cfg.pop("clip_grad", None)}
        if cfg:
            raise ConfigError(f"optim_wrapper: unknown key(s) {sorted(cfg)} for {kind} under DeepSpeedStrategy")
        return kwargs, amp

    def build_config(self, accumulative_counts: int = 1, clip_grad: dict | None = None,
                     amp: dict | None = None) -> dict[str, Any]:
        """The DeepSpeed config dict: the user's keys plus what memfit owns (batch, accumulation,
        clipping, precision). A value given in both places must agree."""
        from deepspeed.accelerator import get_accelerator

        config = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.ds_config.items()}
        micro = self.micro_batch_size or 1  # evaluation only: DeepSpeed still wants a number
        _owned(config, "train_micro_batch_size_per_gpu", micro, "train_dataloader.batch_size")
        _owned(config, "gradient_accumulation_steps", accumulative_counts, "optim_wrapper.accumulative_counts")
        _owned(config, "train_batch_size", micro * accumulative_counts * dist.get_world_size(),
               "batch_size x accumulative_counts x world size")
        if clip_grad:
            _owned(config, "gradient_clipping", float(clip_grad["max_norm"]), "optim_wrapper.clip_grad.max_norm")
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
        if "amp" in config:
            # DeepSpeed removed its Apex AMP integration; Apex O1 is torch autocast (memfit.precision).
            from memfit.precision import APEX_OPT_LEVELS

            apex = dict(config.pop("amp") or {})
            if apex.get("enabled", True):
                level = apex.get("opt_level", "O1")
                amp = amp or {"enabled": True, "dtype": APEX_OPT_LEVELS.get(level, "float16")}
                logger.info(f"DeepSpeedStrategy amp (Apex {level}) runs as torch autocast ({amp['dtype']})")
        half = [mode for mode in ("fp16", "bf16") if (config.get(mode) or {}).get("enabled", False)]
        if amp is not None:
            if half:
                raise ConfigError(f"AmpOptimWrapper (torch autocast) and strategy {half[0]}=dict(enabled=True) "
                                  f"(whole-model half) are two precisions: keep one")
            user = config.get("torch_autocast") or {}
            if user.get("enabled") and str(user.get("dtype", amp["dtype"])).removeprefix("torch.") != amp["dtype"]:
                raise ConfigError(f"strategy.torch_autocast.dtype={user['dtype']!r} and optim_wrapper dtype "
                                  f"{amp['dtype']!r} disagree: set one of them")
            # DeepSpeed reduces the gradients of Linear/Conv weights in the autocast dtype by default; memfit
            # keeps torch AMP's semantics (fp32 gradients, exact against one process) unless the user lists
            # lower_precision_safe_modules to trade that for half the gradient traffic.
            config["torch_autocast"] = {"lower_precision_safe_modules": [], **user, **amp}
        if len(half) > 1:
            raise ConfigError("strategy fp16 and bf16 are both enabled: enable one")
        if half:
            dtype = torch.float16 if half[0] == "fp16" else torch.bfloat16
            if dtype is torch.float16 and not get_accelerator().is_fp16_supported():
                raise ConfigError(f"strategy fp16=dict(enabled=True): DeepSpeed's {get_accelerator().device_name()} "
                                  "accelerator has no fp16 mode; use bf16=dict(enabled=True) or, better, "
                                  "optim_wrapper=dict(type='AmpOptimWrapper') (torch autocast)")
            logger.warning(_HALF_WARNING.format(mode=half[0], dtype=str(dtype).removeprefix("torch.")))
            self.half_dtype = dtype
        elif self.inputs_to_half:
            logger.info("DeepSpeedStrategy inputs_to_half is ignored: the model runs in fp32 (autocast casts "
                        "inside the ops that are safe in half)")
        return config

    # -- placement ---------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.engine.module if self.engine is not None else model

    def load_weights(self, model: nn.Module, path: Any, **options: Any) -> Any:
        """``load_from`` under ZeRO: gather the partitioned parameters (stage 3), load, re-partition,
        and refresh the optimizer's fp32 master copy so the first step starts from the loaded weights."""
        import deepspeed

        from memfit.checkpoint import load_weights

        module = self.unwrap(model)
        gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0)
                  if self.engine.zero_optimization_partition_weights() else contextlib.nullcontext())
        with gather:
            result = load_weights(module, path, **options)
        if hasattr(self.engine.optimizer, "refresh_fp32_params"):
            self.engine.optimizer.refresh_fp32_params()
        return result

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> Any:
        """A placeholder: the engine writes the (sharded) weights itself in ``save_checkpoint``."""
        return EngineState("model")

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        return {**wrapper.state_dict(), "optimizer": EngineState("optimizer")}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on every rank (gathered under ZeRO-3; a collective)."""
        import deepspeed

        module = self.unwrap(model)
        if not self.engine.zero_optimization_partition_weights():
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def save_checkpoint(self, path: str | Path, state: dict) -> None:
        """Write the engine's shards and memfit's extras to a temporary directory, then rename it to
        ``path`` (a crash leaves the previous checkpoint untouched). Every rank must call this."""
        from memfit.checkpoint import check_plain
        from memfit.checkpoint import save_checkpoint as save_state_file

        path = Path(path)
        extras = {k: v for k, v in state.items() if k not in ("state_dict", "grads")}
        if "optim_wrapper" in extras:
            extras["optim_wrapper"] = {k: v for k, v in extras["optim_wrapper"].items() if k != "optimizer"}
        if "grads" in state:
            logger.warning(f"{path.name}: saved inside an accumulation window; DeepSpeed keeps the partial gradients "
                           "in its own buffers, so a resume from it restarts the window. Save at multiples of "
                           "optim_wrapper.accumulative_counts for an exact resume")
        check_plain(extras)
        tmp = path.parent / dist.broadcast_object(f".{path.name}.tmp-{os.getpid()}")
        if dist.is_main_process():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={}, save_latest=False,
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)
        dist.barrier()
        if dist.is_main_process():
            save_state_file(extras, tmp / EXTRAS_FILE)
            if path.exists():  # the same name saved again (e.g. a best checkpoint): swap it out
                old = path.parent / f".{path.name}.old-{os.getpid()}"
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
            fsync_dir(path.parent)
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> dict:
        """Plain extras now; the engine loads its shards when ``restore_state`` reaches the model."""
        from memfit.checkpoint import load_checkpoint as load_state_file

        path = Path(path)
        if not is_deepspeed_checkpoint(path):
            raise CheckpointError(f"{path}: not a DeepSpeed checkpoint directory; a DeepSpeed run resumes from its "
                                  "own checkpoints. To start from these weights use load_from (weights only)")
        state = load_state_file(path / EXTRAS_FILE)
        saved = state.get("meta", {}).get("world_size")
        if saved is not None and saved != dist.get_world_size():
            raise CheckpointError(
                f"{path}: saved by {saved} ranks, this run has {dist.get_world_size()}: DeepSpeed's ZeRO shards "
                f"load at the world size that wrote them. Export the weights (memfit export {path} "
                f"model.safetensors) and start from them with load_from, or convert the shards with DeepSpeed's "
                f"universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {path / ENGINE_TAG} ...)"
            )
        state["state_dict"] = EngineState("model", path)
        if "optim_wrapper" in state:
            state["optim_wrapper"]["optimizer"] = EngineState("optimizer", path)
        return state

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        if not isinstance(state, EngineState):  # a full state dict
            return self.load_weights(model, state, strict=strict)
        with weights_only_loads():
            load_path, _ = self.engine.load_checkpoint(str(state.path), tag=ENGINE_TAG, load_module_strict=strict,
                                                       load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"{state.path}: DeepSpeed found no checkpoint under tag {ENGINE_TAG!r}")
        return None

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        """The optimizer came back with the engine's shards; only the wrapper's counting is left."""
        wrapper.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})


class EngineState:
    """Stands for state that the DeepSpeed engine writes and reads itself (``path`` when loading)."""

    def __init__(self, what: str, path: Path | None = None) -> None:
        self.what, self.path = what, path

    def __repr__(self) -> str:
        return f"EngineState({self.what!r}, {str(self.path) if self.path else None!r})"


def cast_inputs(data: Any, which: list | None = None, dtype: torch.dtype | None = None) -> Any:
    """The seeds' ``inputs_to_half``: cast the floating inputs at these positions (a tuple/list batch) or
    keys (a dict batch) to ``dtype``, as the whole-model half modes need."""
    if not which or dtype is None:
        return data

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    if isinstance(data, Mapping):
        missing = [k for k in which if k not in data]
        if missing:
            raise ConfigError(f"strategy.inputs_to_half={which!r}: the batch is a dict with keys {sorted(data)}; "
                              "name keys of it")
        return type(data)({k: cast(v) if k in which else v for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        bad = [i for i in which if not isinstance(i, int) or i >= len(data)]
        if bad:
            raise ConfigError(f"strategy.inputs_to_half={which!r}: the batch has {len(data)} positional inputs")
        return type(data)(cast(v) if i in which else v for i, v in enumerate(data))
    return cast(data) if 0 in which else data


def keep_batchnorm_fp32(model: nn.Module) -> list[str]:
    """In whole-model half mode, run BatchNorm in fp32 with fp32 running statistics (a bf16 running
    mean keeps 3 significant digits). The half weights are cast up inside autograd, so their
    gradients still reach the engine's half parameters. Returns the names of the layers changed."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for key in ("running_mean", "running_var"):
                buf = getattr(module, key, None)
                if buf is not None:
                    setattr(module, key, buf.float())
            module.forward = types.MethodType(_bn_forward_fp32, module)
            changed.append(name)
    return changed


def _bn_forward_fp32(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    # BatchNorm's own forward, with inputs and affine weights cast to fp32 (torch's CPU kernel does not
    # mix half weights with fp32 statistics) and the output cast back.
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            momentum = 1.0 / float(self.num_batches_tracked)
    use_batch = self.training or self.running_mean is None
    out = nn.functional.batch_norm(
        x.float(), self.running_mean if not self.training or self.track_running_stats else None,
        self.running_var if not self.training or self.track_running_stats else None,
        None if self.weight is None else self.weight.float(), None if self.bias is None else self.bias.float(),
        use_batch, momentum, self.eps)
    return out.to(x.dtype)


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / EXTRAS_FILE).is_file() and (path / ENGINE_TAG).is_dir()


def _deepspeed_safe_globals() -> list[Any]:
    """The plain-data classes DeepSpeed pickles into its checkpoint files (enums, loss scalers, sets)."""
    import collections

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, set, collections.OrderedDict, torch.Size]


@contextlib.contextmanager
def weights_only_loads():
    """Make DeepSpeed's own ``torch.load(weights_only=False)`` calls (engine.load_checkpoint, zero_to_fp32)
    load with ``weights_only=True`` plus an allowlist of DeepSpeed's data classes, so a DeepSpeed checkpoint
    directory cannot run code either. Patching is the only hook: DeepSpeed hard-codes the flag."""
    original = torch.load
    allowed = _deepspeed_safe_globals()

    def safe_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return original(*args, **kwargs)
        except Exception as exc:
            from memfit.checkpoint.io import explain_load_error

            target = Path(str(args[0] if args else kwargs.get("f", "?")))
            cause = explain_load_error(exc, target) if target.is_file() else str(exc).splitlines()[0]
            raise CheckpointError(f"cannot load DeepSpeed checkpoint file {target}: {cause}") from None

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def read_deepspeed_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of a memfit DeepSpeed checkpoint, in one process without a
    process group (DeepSpeed's zero_to_fp32; ZeRO stage 0 checkpoints hold the full module already)."""
    path = Path(path)
    engine_dir = path / ENGINE_TAG
    if any(engine_dir.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads():
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=ENGINE_TAG))
    files = sorted(engine_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise CheckpointError(f"{path}: no DeepSpeed model states under {ENGINE_TAG}/")
    with weights_only_loads():
        module = torch.load(files[0], map_location="cpu")["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}


def _owned(config: dict, key: str, value: Any, source: str) -> None:
    if key in config and config[key] != value:
        raise ConfigError(f"strategy.{key}={config[key]!r} disagrees with {source}={value!r}: memfit sets it from "
                          f"{source}; remove it from the strategy")
    config[key] = value


