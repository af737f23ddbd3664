"""Apex O2/O3: the whole model in half precision, the optimizer stepping fp32 master weights.

``Runner(precision=dict(opt_level='O2'))`` (VISSL's ``AMP_PARAMS.AMP_ARGS``) for the single-device
and DDP strategies. What Apex's ``amp.initialize(model, optimizer, opt_level=...)`` does:

* the model's parameters and buffers are cast to ``dtype`` (float16 on CUDA, bfloat16 on CPU by
  default); with ``keep_batchnorm_fp32`` (O2's default) the norm layers (``_NormBase``: BatchNorm,
  SyncBatchNorm, InstanceNorm) stay fp32, their inputs cast up and outputs cast back down;
* floating inputs of the model's forward are cast to ``dtype`` and its floating outputs back to fp32
  (the loss returned by ``forward(mode='loss')`` is fp32, but computed in half inside the model);
* the optimizer steps fp32 copies of the half parameters (``master_weights``): at each step the half
  gradients move to the masters, the masters step, and the half parameters are refreshed from them;
* with float16 the loss is scaled (``loss_scale``: 'dynamic' or a fixed number, GradScaler-style, see
  :class:`~memfit.precision.scaler.ScaledPrecision`) and steps whose gradients overflowed are skipped
  and counted. bfloat16 has fp32's range: no scaling.

``opt_level='O1'`` is autocast (``AmpOptimWrapper``'s precision) and ``'O0'`` fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.errors import ConfigError, did_you_mean, warn_ignored
from memfit.precision.autocast import amp_precision
from memfit.precision.base import Precision, cpu_has_native_bf16, dtype_name, parse_dtype
from memfit.precision.scaler import ScaledPrecision, check_loss_scale

logger = logging.getLogger("memfit")

OPT_LEVELS = ("O0", "O1", "O2", "O3")
PRECISION_KEYS = ("opt_level", "keep_batchnorm_fp32", "master_weights", "loss_scale", "dtype")
_FP16_BARE = ("precision.master_weights=False with float16: the optimizer would step fp16 weights, losing updates "
              "below fp16's resolution (and GradScaler unscales no fp16 gradients); use master_weights=True or "
              "dtype='bfloat16'")


def _flag(cfg: Mapping, key: str) -> bool | None:
    value = cfg.get(key)
    if isinstance(value, str) and value in ("True", "False"):  # Apex accepts the strings too
        return value == "True"
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"precision.{key}={value!r}: use True, False or None")
    return value


def precision_options(cfg: Any) -> dict[str, Any] | None:
    """Check ``precision=dict(opt_level=..., keep_batchnorm_fp32=..., master_weights=..., loss_scale=...,
    dtype=...)`` where it enters (config validation, the Runner); returns it with every key filled in.
    None stays None (no such setting: the optimizer wrapper and the strategy decide)."""
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"precision must be a dict(opt_level='O1'|'O2'|'O3', ...), got {type(cfg).__name__}")
    for key in cfg:
        if key not in PRECISION_KEYS:
            raise ConfigError(f"precision: unknown key {key!r}: {did_you_mean(str(key), PRECISION_KEYS)}")
    level = cfg.get("opt_level")
    if level not in OPT_LEVELS:
        hint = did_you_mean(str(level), OPT_LEVELS) if level is not None else "use 'O0', 'O1', 'O2' or 'O3'"
        raise ConfigError(f"precision.opt_level={level!r}: {hint}")
    loss_scale = cfg.get("loss_scale", "dynamic")
    check_loss_scale(loss_scale, "precision.loss_scale")
    dtype = parse_dtype(cfg.get("dtype"), "precision.dtype")
    if dtype is torch.float32:
        raise ConfigError("precision.dtype='float32': use opt_level='O0' for fp32, or 'float16'/'bfloat16'")
    if dtype is torch.float16 and _flag(cfg, "master_weights") is False:
        raise ConfigError(_FP16_BARE)
    return dict(opt_level=level, keep_batchnorm_fp32=_flag(cfg, "keep_batchnorm_fp32"),
                master_weights=_flag(cfg, "master_weights"), loss_scale=loss_scale, dtype=dtype)


def precision_from_cfg(cfg: Any, device_type: str) -> Precision | None:
    """The Precision a ``precision=dict(opt_level=...)`` setting asks for on ``device_type``."""
    options = precision_options(cfg)
    if options is None:
        return None
    level = options["opt_level"]
    if level in ("O0", "O1"):
        for key in ("keep_batchnorm_fp32", "master_weights"):
            if options[key] is not None:
                warn_ignored(f"precision.{key} with opt_level={level!r}", "it applies to O2/O3 (a half model)")
        if level == "O0":
            return Precision(device_type)
        return amp_precision(options["dtype"], device_type, options["loss_scale"])
    dtype = options["dtype"] or (torch.float16 if device_type == "cuda" else torch.bfloat16)
    if device_type == "cpu" and dtype is torch.bfloat16 and not cpu_has_native_bf16():
        cpu = torch.backends.cpu.get_cpu_capability()
        logger.warning(f"precision opt_level={level!r}: bfloat16 on this CPU ({cpu}) is emulated: its memory "
                       "savings hold, its speed does not")
    return MasterWeightsPrecision(dtype, device_type, level, options["keep_batchnorm_fp32"],
                                  options["master_weights"], options["loss_scale"])


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors (nested in lists, tuples, dicts) cast to ``dtype``; anything else as it is."""
    def leaf(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return tree_map(leaf, value)


class CastInputs:
    """A forward pre-hook (with kwargs) casting a module's floating inputs to ``dtype``. A small class,
    not a bound method of the precision: a deepcopy of the model (EMA) copies only the dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast(args, self.dtype), _cast(kwargs, self.dtype)


class CastOutputs:
    """A forward hook casting a module's floating outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast(output, self.dtype)


def cast_model(model: nn.Module, dtype: torch.dtype, keep_norms_fp32: bool) -> list[str]:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place, each module's own only, so
    kept norm layers are never rounded through half; returns the names of the norms kept in fp32.

    A kept norm's inputs are cast to fp32 and its outputs back to ``dtype`` by hooks, so it computes in
    fp32 (its backward saves an fp32 copy of its input). BatchNorm kernels would take a half input with
    fp32 weights directly, but on an H100 their weight gradients were measured ~1% off the fp32 ones for
    bf16 inputs and for eval-mode fp16 (torch 2.11), so memfit does not rely on them.
    """
    kept = []
    for name, module in model.named_modules():
        if keep_norms_fp32 and isinstance(module, nn.modules.batchnorm._NormBase):
            module.register_forward_pre_hook(CastInputs(torch.float32), with_kwargs=True)
            module.register_forward_hook(CastOutputs(dtype))
            kept.append(name)
            continue
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return kept


class MasterWeightsPrecision(ScaledPrecision):
    """Apex O2/O3 (module doc). ``keep_batchnorm_fp32=None``: True for O2, False for O3, as Apex.
    ``master_weights`` (default True for both; Apex's O3 default is False): False steps the half
    parameters themselves, which memfit allows for bfloat16 only."""

    def __init__(self, dtype: torch.dtype, device_type: str = "cpu", opt_level: str = "O2",
                 keep_batchnorm_fp32: bool | None = None, master_weights: bool | None = True,
                 loss_scale: str | float | dict = "dynamic") -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"precision.dtype={dtype_name(dtype)!r}: O2/O3 cast the model to 'float16' or 'bfloat16'")
        if opt_level not in ("O2", "O3"):
            raise ConfigError(f"precision.opt_level={opt_level!r}: master weights are O2/O3's")
        self.master_weights = True if master_weights is None else bool(master_weights)
        if not self.master_weights and dtype is torch.float16:
            raise ConfigError(_FP16_BARE)
        super().__init__(dtype, device_type, loss_scale, key="precision.loss_scale")
        self.opt_level = opt_level
        self.keep_batchnorm_fp32 = opt_level == "O2" if keep_batchnorm_fp32 is None else bool(keep_batchnorm_fp32)
        self.name = f"{opt_level}-{'bf16' if dtype is torch.bfloat16 else 'fp16'}"
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fp32 master, half parameter)
        self._versions: list[int] = []
        self._unscaled = False

    # -- the model ---------------------------------------------------------------------------
    def convert_module(self, model: nn.Module) -> nn.Module:
        kept = cast_model(model, self.dtype, self.keep_batchnorm_fp32)
        model.register_forward_pre_hook(CastInputs(self.dtype), with_kwargs=True)
        model.register_forward_hook(CastOutputs(torch.float32))
        logger.info(f"precision {self.opt_level}: model cast to {dtype_name(self.dtype)}"
                    + (f", {len(kept)} norm layers kept in float32" if kept else "")
                    + (", fp32 master weights" if self.master_weights else ""))
        return model

    def prepare_optimizer(self, optim_wrapper: Any) -> None:
        """Put an fp32 master in place of every half parameter in the optimizer's groups (Apex's
        ``amp.initialize(model, optimizer)``); fp32 parameters (kept norms) are stepped as they are."""
        if hasattr(optim_wrapper, "optim_wrappers"):
            raise ConfigError(f"precision opt_level={self.opt_level!r} keeps the master weights of one optimizer; "
                              "several optimizers (OptimWrapperDict) are not supported with it: use opt_level='O1'")
        if not self.master_weights:
            return
        optimizer = optim_wrapper.optimizer
        if any(optimizer.state.values()):
            raise ConfigError("precision O2/O3: the optimizer already holds state; set the precision up before a step")
        self.pairs = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if p.dtype == self.dtype:
                    master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                    self.pairs.append((master, p))
                    p = master
                params.append(p)
            group["params"] = params
        self._versions = [p._version for _, p in self.pairs]

    def _follow_outside_changes(self) -> None:
        """A half parameter written outside the optimizer (``load_from`` after set-up, a user's copy_)
        has a new version and a value its master does not round to: the master takes that value."""
        for i, (master, p) in enumerate(self.pairs):
            if p._version != self._versions[i]:
                with torch.no_grad():
                    if not torch.equal(p, master.to(p.dtype)):
                        master.copy_(p)
                self._versions[i] = p._version

    def _refresh_params(self) -> None:
        with torch.no_grad():
            for master, p in self.pairs:
                p.copy_(master)
        self._versions = [p._version for _, p in self.pairs]

    # -- the step ----------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # Scaled in fp32: a half loss times 2**16 would overflow before backward even starts.
        return super().scale_loss(loss.float() if self.scaler is not None else loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Move each half gradient to its fp32 master (the half one is freed), then unscale (fp16)."""
        self._follow_outside_changes()
        for master, p in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        super().unscale(optimizer)
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """Step the masters (skipped when fp16 gradients overflowed), then refresh the half parameters."""
        if not self._unscaled:
            self.unscale(optimizer)
        super().step(optimizer, **kwargs)
        self._unscaled = False
        self._refresh_params()

    def zero_grad(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        optimizer.zero_grad(**kwargs)
        for _, p in self.pairs:
            p.grad = None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (fp16) and the fp32 masters in the optimizer's order: the checkpoint's
        model weights are half, the masters make a resume exact."""
        state = super().state_dict()
        if self.pairs:
            state["master_weights"] = [master.detach() for master, _ in self.pairs]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        masters = state.get("master_weights")
        if masters is None or not self.pairs:
            return
        shapes = [tuple(m.shape) for m, _ in self.pairs]
        if [tuple(m.shape) for m in masters] != shapes:
            raise ConfigError(f"precision: the checkpoint's {len(masters)} master weights do not fit this "
                              f"optimizer's {len(shapes)} half parameters; resume with the same model and optimizer")
        with torch.no_grad():
            for (master, _), saved in zip(self.pairs, masters):
                master.copy_(saved)
        self._refresh_params()

    def __repr__(self) -> str:
        return (f"MasterWeightsPrecision({self.opt_level}, {dtype_name(self.dtype)}, keep_batchnorm_fp32="
                f"{self.keep_batchnorm_fp32}, master_weights={self.master_weights}, loss_scale={self.loss_scale!r})")
