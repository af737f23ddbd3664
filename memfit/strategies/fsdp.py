"""FSDPStrategy: FSDP2 (``torch.distributed.fsdp.fully_shard``) per block, and sharded checkpoints.

Parameters, gradients and optimizer state are sharded over the ranks; each FSDP unit all-gathers
its parameters just before its forward (and again in backward) and frees them after. Which modules
become units comes from, in order of precedence:

- ``wrap_modules=['SwinTransformerBlock', 'backbone.layers.0', MyBlock]``: class names, module names
  or classes;
- ``model_wrapper=dict(auto_wrap_policy=...)`` (the FSDP1 form of MMEngine's large-model training
  guide): a policy callable such as ``partial(size_based_auto_wrap_policy, min_num_params=1e7)`` or
  ``transformer_auto_wrap_policy``, or a policy object such as ``ModuleWrapPolicy({Block})``,
  evaluated over the module tree exactly as FSDP1 would, to pick the units;
- nothing: the model's repeated block types (every module class that occurs at least twice and
  holds parameters in its children - leaf layers only when there is no such block; the outermost
  such modules become units).

The root module is always the last unit. Activation checkpointing (the runner's transforms) is
installed before wrapping, on the module's ``forward``, so a checkpointed block recomputes inside
its own FSDP unit's all-gather, once. Checkpoints are ``torch.distributed.checkpoint`` directories
that each rank writes its shards into; they load at any world size, and in one process without a
process group (:func:`read_sharded_checkpoint`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from memfit import dist
from memfit.checkpoint.dcp import fqn_optim_state, load_dcp_into, write_dcp
from memfit.checkpoint.directory import PendingSave, StateRef, read_extras, save_directory, split_state
from memfit.errors import ConfigError, did_you_mean
from memfit.precision import HalfPrecision, Precision, parse_dtype
from memfit.registry import STRATEGIES
from memfit.strategies.base import Strategy
from memfit.strategies.capabilities import Capabilities, shards_up_to
from memfit.strategies.fsdp_compat import state_dict_type_from, warn_device_id, warn_fsdp1_only
from memfit.strategies.fsdp_units import select_units

# FSDP1 constructor arguments accepted in ``model_wrapper`` / ``model_wrapper_cfg`` (MMEngine's
# MMFullyShardedDataParallel). Ones FSDP2 has no switch for warn unless set as FSDP2 behaves (fsdp_compat).
_WRAPPER_KEYS = ("type", "auto_wrap_policy", "cpu_offload", "mixed_precision", "sharding_strategy",
                 "use_orig_params", "sync_module_states", "device_id", "limit_all_gathers",
                 "forward_prefetch", "backward_prefetch", "param_init_fn", "reshard_after_forward")


@STRATEGIES.register()
class FSDPStrategy(Strategy):
    """Fully sharded data parallel with FSDP2, one unit per block.

    ``reshard_after_forward`` frees gathered parameters after each unit's forward (ZeRO-3; False
    keeps them until backward, ZeRO-2-like). ``cpu_offload`` keeps the sharded parameters,
    gradients and optimizer state on the CPU. ``mixed_precision=dict(param_dtype='bfloat16',
    reduce_dtype='float32')`` computes in the parameter dtype and reduces gradients in the reduce
    dtype. ``state_dict_type='sharded'`` saves DCP directories; ``'full'`` gathers everything into
    one file on rank 0. ``activation_checkpointing`` (names/types, as ``cfg.activation_checkpointing``)
    is applied before sharding. ``model_wrapper`` takes the FSDP1 arguments of MMEngine's guides (see fsdp_compat).
    ``skip_init_weights=True``: the runner skips ``model.init_weights()`` (``init_cfg``), for weights
    that ``load_from`` brings anyway.

    ``async_save=True`` writes sharded checkpoints with ``torch.distributed.checkpoint.async_save``:
    the shards are copied to CPU memory and written by a background thread (over a dedicated gloo
    group) while training continues. The directory is renamed to its final name, and
    ``last_checkpoint`` moved to it, only once every rank's write completed: before the next save
    starts, and at the end of training (:meth:`finalize_checkpoints`).
    """

    def __init__(
        self,
        wrap_modules: Iterable[Any] | None = None,
        model_wrapper: dict | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool | Any = False,
        mixed_precision: dict | Any = None,
        state_dict_type: str = "sharded",
        state_dict_cfg: str | dict | None = None,
        activation_checkpointing: Any = None,
        sync_module_states: bool = True,
        skip_init_weights: bool = False,
        async_save: bool = False,
    ) -> None:
        super().__init__()
        wrapper = dict(model_wrapper or {})
        unknown = sorted(set(wrapper) - set(_WRAPPER_KEYS))
        if unknown:
            raise ConfigError(f"FSDPStrategy.model_wrapper: unsupported key {unknown[0]!r}: "
                              f"{did_you_mean(unknown[0], _WRAPPER_KEYS)}")
        self.wrap_modules = list(wrap_modules) if wrap_modules is not None else None
        self.auto_wrap_policy = wrapper.get("auto_wrap_policy")
        if self.auto_wrap_policy is not None and not callable(self.auto_wrap_policy) \
                and not hasattr(self.auto_wrap_policy, "_run_policy"):
            raise ConfigError(f"FSDPStrategy.model_wrapper.auto_wrap_policy={self.auto_wrap_policy!r}: use a policy "
                              "callable, e.g. partial(size_based_auto_wrap_policy, min_num_params=1e7)")
        if self.wrap_modules is not None and self.auto_wrap_policy is not None:
            raise ConfigError("FSDPStrategy: wrap_modules and model_wrapper.auto_wrap_policy both choose the units: "
                              "give one of them")
        self.reshard_after_forward = _reshard_from(wrapper, reshard_after_forward)
        self.cpu_offload = _offload_flag(wrapper.get("cpu_offload", cpu_offload))
        self.mixed_precision = _mp_policy(wrapper.get("mixed_precision", mixed_precision))
        self.sync_module_states = bool(wrapper.get("sync_module_states", sync_module_states))
        self.device_id = wrapper.get("device_id")  # compared with the device memfit picks, in wrap()
        warn_fsdp1_only(wrapper)
        self.skip_init_weights = bool(skip_init_weights)  # the runner then skips model.init_weights()
        if state_dict_cfg is not None:
            state_dict_type = state_dict_type_from(state_dict_cfg)
        if state_dict_type not in ("sharded", "full"):
            raise ConfigError(f"FSDPStrategy.state_dict_type={state_dict_type!r}: use 'sharded' or 'full'")
        self.state_dict_type = state_dict_type
        if async_save and state_dict_type != "sharded":
            raise ConfigError("FSDPStrategy(async_save=True) needs state_dict_type='sharded' (a 'full' "
                              "checkpoint is gathered and written by rank 0 synchronously)")
        self.async_save = bool(async_save)
        self._async_group: Any = None  # the gloo group the background writes use (made at the first one)
        self._pending: PendingSave | None = None  # the async save not yet finalized
        self.activation_checkpointing = activation_checkpointing
        self.units: list[str] = []  # names of the modules sharded as units (root last, as '')

    @property
    def capabilities(self) -> Capabilities:
        """ZeRO-3 (ZeRO-2 with ``reshard_after_forward=False``); fully_shard needs contiguous parameters."""
        return Capabilities(shards=shards_up_to(3 if self.reshard_after_forward else 2), data_parallel=True,
                            offloads_parameters=bool(self.cpu_offload), contiguous_parameters=True,
                            config_hint="strategy='fsdp' (FSDPStrategy)",
                            sharded_checkpoints=self.state_dict_type == "sharded", partial_gradients=False)

    @classmethod
    def fake_step_options(cls, cfg: dict) -> dict:
        """On CPU (fake) tensors the CPU offload moves nothing: the step holds what the same step without it holds
        (measured equal, phase by phase); what leaves a CUDA device is taken out by the predictor."""
        return {"reshard_after_forward": True, **cfg, "cpu_offload": False}

    # -- environment -------------------------------------------------------------------------
    def setup_env(self, launcher: str = "none", env_cfg: dict | None = None) -> None:
        """As the base, and a one-process group when not launched, so FSDP also runs in one process."""
        super().setup_env(dist.launcher_from_env(launcher), env_cfg)
        dist.ensure_process_group((env_cfg or {}).get("dist_cfg") or {})

    # -- precision ---------------------------------------------------------------------------
    def precision_request(self) -> Precision | None:
        """``mixed_precision=dict(param_dtype=...)``: whole-model half compute with fp32 sharded
        parameters (FSDP2's MixedPrecisionPolicy), a :class:`HalfPrecision`."""
        mp = self.mixed_precision
        if not mp or mp.get("param_dtype") in (None, torch.float32):
            return None
        return HalfPrecision(mp["param_dtype"], mp.get("reduce_dtype"), mp.get("output_dtype"),
                             mp.get("cast_forward_inputs", True))

    def check_precision(self, precision: Precision) -> None:
        """FSDP casts parameters itself (HalfPrecision) or runs under autocast: both work. Apex O2/O3
        (memfit's master weights) is refused: FSDP's sharded fp32 parameters are the masters."""
        self.refuse_master_weights(precision, "strategy mixed_precision=dict(param_dtype='bfloat16') (fp32 sharded "
                                              "masters, half compute) or precision=dict(opt_level='O1') (autocast)")

    # -- wrapping ----------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from memfit.strategies import dtensor_foreach

        dtensor_foreach.install()  # the optimizer's first foreach step over DTensors, without a quadratic walk
        if self.activation_checkpointing:
            from memfit.memory.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model, self.activation_checkpointing)
        warn_device_id(self.device_id, self.device)
        if self.sync_module_states and dist.get_world_size() > 1:
            _broadcast_module_states(model)
        with unset_fake_temporarily():  # the planner wraps fake models: the mesh itself is real
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        if isinstance(self.precision, HalfPrecision):
            mp = MixedPrecisionPolicy(**self.precision.fsdp_policy_kwargs())
        else:  # fp32 compute or autocast; a reduce_dtype alone still applies
            mp = MixedPrecisionPolicy(**{k: v for k, v in (self.mixed_precision or {}).items() if k != "param_dtype"})
        kwargs = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp,
                      offload_policy=offload)
        units = select_units(model, self.wrap_modules, self.auto_wrap_policy)
        # Children before parents: FSDP2 requires nested units to be sharded bottom-up.
        for name in sorted(units, key=lambda n: -n.count(".")):
            fully_shard(units[name], **kwargs)
        fully_shard(model, **kwargs)
        self.units = [*sorted(units), ""]
        return model

    # -- the step ----------------------------------------------------------------------------
    def no_sync(self, model: nn.Module, sync: bool) -> Any:
        """Reduce-scatter gradients only when ``sync``; the flag stays set for the backward that
        follows the forward (it runs after this context closes), and every micro-step sets it anew."""
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, **kw: Any):
        """Clip sharded (DTensor) gradients by their global norm; the norm is returned as a plain tensor."""
        norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, **kw)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # -- state -------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Sharded (DTensor) state for a sharded checkpoint; gathered full tensors (on CPU, rank 0) for 'full'."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = self.state_dict_type == "full"
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def optim_state_dict(self, model: nn.Module, wrapper: Any) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = self.state_dict_type == "full"
        state = wrapper.checkpoint_state(with_optimizer=False)
        state["optimizer"] = get_optimizer_state_dict(
            model, wrapper.optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
        return state

    def load_weights(self, model: nn.Module, path: Any, **options: Any) -> Any:
        """``load_from`` into the sharded model: every rank reads the full weights and keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from memfit.checkpoint import read_state_dict, remap_keys

        strict = options.pop("strict", True)
        state = read_state_dict(path, map_location=options.pop("map_location", "cpu"))
        state = remap_keys(state, source=str(path), **options)
        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
        return sorted(result.missing_keys), sorted(result.unexpected_keys)

    def load_model_state_dict(self, model: nn.Module, state: Any, strict: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        if isinstance(state, StateRef):
            target = get_model_state_dict(model)
            load_dcp_into(state.path, state.key, target)
            state = target
            options = StateDictOptions(strict=strict)
        else:  # a full state dict from a file checkpoint (every rank holds it)
            options = StateDictOptions(full_state_dict=True, strict=strict)
        return set_model_state_dict(model, state, options=options)

    def load_optim_state_dict(self, model: nn.Module, wrapper: Any, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        osd = state["optimizer"]
        if isinstance(osd, StateRef):
            target = get_optimizer_state_dict(model, wrapper.optimizer)  # initialises the state to load into
            load_dcp_into(osd.path, osd.key, target)
            set_optimizer_state_dict(model, wrapper.optimizer, target)
        else:
            osd = fqn_optim_state(model, wrapper.optimizer, osd)
            set_optimizer_state_dict(model, wrapper.optimizer, osd, options=StateDictOptions(full_state_dict=True))
        wrapper.load_checkpoint_state({**state, "optimizer": wrapper.optimizer.state_dict()})

    def save_checkpoint(self, path: str | Path, state: dict) -> bool:
        """Write ``state`` at ``path``; False when the write goes on in the background (``async_save``):
        the checkpoint appears, and ``last_checkpoint`` points at it, when it is finalized."""
        self.finalize_checkpoints()  # one write at a time: the previous one becomes last first
        if self.state_dict_type == "full":
            super().save_checkpoint(path, state)
            return True
        tensors, extras = split_state(state)
        extras["sharded"] = {"format": "torch.distributed.checkpoint", "entries": sorted(tensors)}
        if self.async_save and self._async_group is None:
            # Background collectives must not share a group with the training step's collectives.
            self._async_group = tdist.new_group(backend="gloo")
        group = self._async_group if self.async_save else None
        self._pending = save_directory(path, extras, functools.partial(write_dcp, tensors, async_group=group),
                                       background=self.async_save)
        return self._pending is None

    def finalize_checkpoints(self, abort: bool = False) -> None:
        """Wait for a pending async save, publish its directory and point ``last_checkpoint`` at it.

        A collective. ``abort=True`` (training failed) only drops it: the write is left as its hidden
        temporary directory and the previous checkpoint stays the last one.
        """
        pending, self._pending = self._pending, None
        if pending is None or abort:
            return
        from memfit.checkpoint import write_latest

        pending.finish()
        if dist.is_main_process():
            write_latest(pending.path.parent, pending.path.name)
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> dict:
        """A sharded directory: plain extras now, tensors as :class:`StateRef` read in place later."""
        from memfit.checkpoint import is_dcp_checkpoint

        if not is_dcp_checkpoint(path):
            return super().load_checkpoint(path)
        path = Path(path)
        extras = read_extras(path)
        extras["state_dict"] = StateRef(path, "state_dict")
        if "optim_wrapper" in extras:
            extras["optim_wrapper"]["optimizer"] = StateRef(path, "optimizer")
        return extras


# -- option parsing ------------------------------------------------------------------------------
def _reshard_from(wrapper: dict, default: bool) -> bool:
    if "reshard_after_forward" in wrapper:
        return bool(wrapper["reshard_after_forward"])
    strategy = wrapper.get("sharding_strategy")
    if strategy is None:
        return bool(default)
    name = getattr(strategy, "name", str(strategy)).upper()
    if name == "FULL_SHARD":
        return True
    if name == "SHARD_GRAD_OP":
        return False
    raise ConfigError(f"FSDPStrategy.model_wrapper.sharding_strategy={name!r}: use FULL_SHARD or SHARD_GRAD_OP "
                      "(NO_SHARD is DDPStrategy; hybrid sharding is not supported)")


def _offload_flag(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, dict):
        return bool(value.get("offload_params", True))
    if isinstance(value, (str, int, float)):  # 'yes' or 1 would read as on
        raise ConfigError(f"strategy.cpu_offload={value!r}: use True or False (or dict(offload_params=True), "
                          "FSDP's CPUOffload)")
    return bool(getattr(value, "offload_params", True))  # FSDP1 CPUOffload / FSDP2 CPUOffloadPolicy


def _mp_policy(value: Any) -> dict | None:
    """``dict(param_dtype=..., reduce_dtype=...)`` or an FSDP1 MixedPrecision as MixedPrecisionPolicy kwargs."""
    if value is None:
        return None
    if not isinstance(value, dict):
        value = {k: getattr(value, k) for k in ("param_dtype", "reduce_dtype", "output_dtype") if hasattr(value, k)}
    allowed = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs", "buffer_dtype")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ConfigError(f"FSDPStrategy.mixed_precision: unknown key {unknown[0]!r}: use param_dtype, reduce_dtype")
    out = {k: parse_dtype(v, f"FSDPStrategy.mixed_precision.{k}") for k, v in value.items()
           if k in ("param_dtype", "reduce_dtype", "output_dtype") and v is not None}
    if "cast_forward_inputs" in value:
        out["cast_forward_inputs"] = bool(value["cast_forward_inputs"])
    return out or None


def _broadcast_module_states(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (FSDP1's sync_module_states; DDP does the same).

    Sorted by name so that every rank issues the same collectives in the same order.
    """
    with torch.no_grad():
        for _, t in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda kv: kv[0]):
            tdist.broadcast(t.data, src=0)

