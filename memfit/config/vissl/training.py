"""The training half of the VISSL translation: optimizer, lr schedule, precision, strategy, checkpoints,
logging and the process layout (the model and data half is in :mod:`memfit.config.vissl.translate`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from memfit.config.schema import suggest
from memfit.config.vissl.keys import BASE_OPTIMIZER_KEYS, KEYS, Vissl, as_int, refuse
from memfit.config.vissl.schedules import auto_scale_schedule, check_schedule, schedule_value
from memfit.errors import ConfigError, warn_ignored

# VISSL's lr schedule defaults (defaults.yaml), under the file's own values.
LR_DEFAULTS: dict[str, Any] = dict(
    auto_lr_scaling=dict(auto_scale=False, base_value=0.1, base_lr_batch_size=256, scaling_type="linear"),
    name="multistep", update_interval="epoch", values=[0.1, 0.01, 0.001], milestones=[30, 60], schedulers=[],
    interval_scaling=[], lengths=[], start_value=0.1, end_value=0.0, value=0.1)
APEX_ARGS = ("opt_level", "keep_batchnorm_fp32", "master_weights", "loss_scale")
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}


def training_sections(get: Vissl, num_epochs: int) -> dict[str, Any]:
    """optim_wrapper, param_scheduler, strategy, precision, cfg, hooks, resume, ... for a VISSL config."""
    out: dict[str, Any] = {}
    lr = _schedule(get, num_epochs)
    optimizer, zero = _optimizer(get, schedule_value(lr, 0.0))
    wrapper: dict[str, Any] = dict(type="OptimWrapper", optimizer=optimizer)
    paramwise = _paramwise(get, optimizer.get("weight_decay", 0.0))
    if paramwise:
        wrapper["paramwise_cfg"] = paramwise
    if get("MODEL.GRAD_CLIP.USE_GRAD_CLIP"):
        clip = "MODEL.GRAD_CLIP."
        wrapper["clip_grad"] = dict(max_norm=get(clip + "MAX_NORM"), norm_type=get(clip + "NORM_TYPE"))
    precision = _precision(get, wrapper)
    out["optim_wrapper"] = wrapper
    out["param_scheduler"] = dict(type="VisslLR", by_epoch=lr.get("update_interval") == "epoch", **lr)
    if precision is not None:
        out["precision"] = precision
    strategy = _strategy(get, zero)
    if strategy is not None:
        out["strategy"] = strategy
    if get("MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING"):
        splits = as_int(get("MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS"),
                        "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS")
        out["cfg"] = dict(activation_checkpointing=dict(splits=splits, module="trunk"))
    out.update(_runtime(get))
    return out


# -- optimizer ---------------------------------------------------------------------------------------------
def _optimizer(get: Vissl, lr: float) -> tuple[dict[str, Any], bool]:
    """The optimizer config and whether ZeRO shards it (``name: zero`` or ``use_zero``)."""
    name, zero = get("OPTIMIZER.name"), bool(get("OPTIMIZER.use_zero"))
    opts = {k: get(f"OPTIMIZER.{k}") for k in BASE_OPTIMIZER_KEYS if k != "larc_config"}
    opts["larc_config"] = {k: get(f"OPTIMIZER.larc_config.{k}") for k in ("clip", "eps", "trust_coefficient")}
    where = "OPTIMIZER"
    if name == "zero":
        base = get("OPTIMIZER.base_optimizer")
        if not isinstance(base, Mapping) or "name" not in base:
            raise ConfigError("VISSL key config.OPTIMIZER.base_optimizer: name: zero needs the optimizer it shards, "
                              "e.g. base_optimizer: {name: sgd, momentum: 0.9, weight_decay: 0.0001}")
        for key in base:
            if key not in BASE_OPTIMIZER_KEYS:
                raise ConfigError(f"unknown VISSL key 'config.OPTIMIZER.base_optimizer.{key}': "
                                  f"{suggest(str(key), BASE_OPTIMIZER_KEYS)}")
        opts.update({k: v for k, v in base.items() if k != "larc_config"})
        opts["larc_config"].update(base.get("larc_config") or {})
        name, zero, where = base["name"], True, "OPTIMIZER.base_optimizer"
    if name not in OPTIMIZERS:
        raise refuse(f"{where}.name", name, "memfit translates sgd, adam, adamw and zero (over one of them)")
    optimizer: dict[str, Any] = dict(type=OPTIMIZERS[name], lr=lr, weight_decay=opts["weight_decay"])
    if name == "sgd":
        optimizer.update(momentum=opts["momentum"], nesterov=opts["nesterov"])
    else:
        optimizer.update(betas=tuple(opts["betas"]), eps=opts["eps"], amsgrad=opts["amsgrad"])
    if opts["use_larc"]:
        if name != "sgd":
            raise refuse(f"{where}.use_larc", True, "VISSL applies LARC to sgd only")
        larc = opts["larc_config"]
        unknown = [k for k in larc if k not in ("clip", "eps", "trust_coefficient")]
        if unknown:
            raise ConfigError(f"unknown VISSL key 'config.{where}.larc_config.{unknown[0]}': "
                              f"{suggest(str(unknown[0]), ('clip', 'eps', 'trust_coefficient'))}")
        optimizer.update(type="Larc", clip=bool(larc["clip"]), eps=larc["eps"],
                         trust_coefficient=larc["trust_coefficient"])
    return optimizer, zero


def _paramwise(get: Vissl, weight_decay: float) -> dict[str, Any]:
    if get("OPTIMIZER.construct_single_param_group_only"):
        return {}
    out: dict[str, Any] = {}
    if not get("OPTIMIZER.regularize_bn"):
        out["norm_decay_mult"] = 0.0
    if not get("OPTIMIZER.regularize_bias"):
        out["bias_decay_mult"] = 0.0
    keys = {str(name): dict(decay_mult=0.0) for name in get("OPTIMIZER.non_regularized_parameters")}
    if get("OPTIMIZER.head_optimizer_params.use_different_wd"):
        head_wd = get("OPTIMIZER.head_optimizer_params.weight_decay")
        if not weight_decay:
            raise refuse("OPTIMIZER.head_optimizer_params.use_different_wd", True,
                         "memfit scales the heads' decay by a multiple of OPTIMIZER.weight_decay, which is 0")
        keys["heads"] = dict(decay_mult=head_wd / weight_decay)
    if keys:
        out["custom_keys"] = keys
    return out


def _schedule(get: Vissl, num_epochs: int) -> dict[str, Any]:
    """VISSL's lr schedule over its defaults, auto-scaled as VISSL scales it, then checked."""
    key = "OPTIMIZER.param_schedulers.lr"
    given = get(key)
    if not isinstance(given, Mapping):
        raise ConfigError(f"VISSL key config.{key} must be a dict with 'name', got {given!r}")
    lr = {**LR_DEFAULTS, **given}
    lr["auto_lr_scaling"] = {**LR_DEFAULTS["auto_lr_scaling"], **(given.get("auto_lr_scaling") or {})}
    for k in lr["auto_lr_scaling"]:
        if k not in LR_DEFAULTS["auto_lr_scaling"]:
            raise ConfigError(f"unknown VISSL key 'config.{key}.auto_lr_scaling.{k}': "
                              f"{suggest(str(k), LR_DEFAULTS['auto_lr_scaling'])}")
    checked = check_schedule(lr, f"VISSL key config.{key}", num_epochs)
    scaled = auto_scale_schedule(
        {**checked, "auto_lr_scaling": lr["auto_lr_scaling"]}, key=f"VISSL key config.{key}",
        batch_size_per_replica=as_int(get("DATA.TRAIN.BATCHSIZE_PER_REPLICA"), "DATA.TRAIN.BATCHSIZE_PER_REPLICA"),
        num_nodes=as_int(get("DISTRIBUTED.NUM_NODES"), "DISTRIBUTED.NUM_NODES"),
        num_proc_per_node=as_int(get("DISTRIBUTED.NUM_PROC_PER_NODE"), "DISTRIBUTED.NUM_PROC_PER_NODE"))
    return check_schedule(scaled, f"VISSL key config.{key}", num_epochs)


# -- precision and strategy --------------------------------------------------------------------------------
def _precision(get: Vissl, wrapper: dict[str, Any]) -> dict[str, Any] | None:
    """Apex O1 (or AMP_TYPE pytorch) -> AmpOptimWrapper; O2/O3 -> the run's ``precision`` entry."""
    if not get("MODEL.AMP_PARAMS.USE_AMP"):
        return None
    key = "MODEL.AMP_PARAMS.AMP_ARGS"
    args = dict(get(key) or {})
    for arg in args:
        if arg not in APEX_ARGS:
            raise refuse(f"{key}.{arg}", args[arg], f"memfit reads Apex's {', '.join(APEX_ARGS)}")
    amp_type = get("MODEL.AMP_PARAMS.AMP_TYPE")
    if amp_type not in ("apex", "pytorch"):
        raise refuse("MODEL.AMP_PARAMS.AMP_TYPE", amp_type, "use apex or pytorch")
    level = args.get("opt_level", "O1") if amp_type == "apex" else "O1"  # torch AMP is autocast: O1's
    if level == "O0":
        return None
    if level == "O1":
        wrapper["type"] = "AmpOptimWrapper"  # dtype None: fp16 on CUDA, bf16 on CPUs that have it natively
        wrapper["loss_scale"] = args.get("loss_scale", "dynamic")
        for arg in ("keep_batchnorm_fp32", "master_weights"):
            if arg in args:
                warn_ignored(f"VISSL key config.{key}.{arg} with opt_level O1",
                             "autocast keeps weights and BatchNorm in fp32 anyway")
        return None
    if level not in ("O2", "O3"):
        raise refuse(f"{key}.opt_level", level, "use O0, O1, O2 or O3")
    # Apex's defaults for the arguments left out (O2: BN fp32, master weights, dynamic scale; O3: none)
    # are the precision setting's own.
    return dict(opt_level=level, **{k: v for k, v in args.items() if k != "opt_level"})


def _strategy(get: Vissl, zero: bool) -> dict[str, Any] | None:
    options: dict[str, Any] = {}
    if zero:
        options["zero"] = True
    if not get("DISTRIBUTED.BROADCAST_BUFFERS"):
        options["broadcast_buffers"] = False
    if get("DATA.DDP_BUCKET_CAP_MB") != KEYS["DATA.DDP_BUCKET_CAP_MB"].default:
        options["bucket_cap_mb"] = get("DATA.DDP_BUCKET_CAP_MB")
    return dict(type="DDPStrategy", **options) if options else None


# -- checkpoints, logging, processes -----------------------------------------------------------------------
def _runtime(get: Vissl) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hooks: dict[str, Any] = dict(logger=dict(interval=as_int(get("LOG_FREQUENCY"), "LOG_FREQUENCY")),
                                 checkpoint=dict(interval=as_int(get("CHECKPOINT.CHECKPOINT_FREQUENCY"),
                                                                 "CHECKPOINT.CHECKPOINT_FREQUENCY")))
    out["default_hooks"] = hooks
    every = get("CHECKPOINT.CHECKPOINT_ITER_FREQUENCY")
    if every != -1:
        every = as_int(every, "CHECKPOINT.CHECKPOINT_ITER_FREQUENCY")
        out["custom_hooks"] = [dict(type="CheckpointHook", interval=every, by_epoch=False, save_last=False)]
    if "CHECKPOINT.DIR" in get:
        out["work_dir"] = str(get("CHECKPOINT.DIR"))
    out["resume"] = bool(get("CHECKPOINT.AUTO_RESUME"))
    out["randomness"] = dict(seed=as_int(get("SEED_VALUE"), "SEED_VALUE", 0))
    if get("REPRODUCIBILITY.CUDDN_DETERMINISTIC"):
        out["randomness"]["deterministic"] = True
    if "DISTRIBUTED.BACKEND" in get:
        out["env_cfg"] = dict(dist_cfg=dict(backend=get("DISTRIBUTED.BACKEND")))
    if get("VERBOSE"):
        out["log_level"] = "DEBUG"
    if get("HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD"):
        out["visualizer"] = dict(type="Visualizer", vis_backends=[dict(type="LocalVisBackend"),
                                                                  dict(type="TensorboardVisBackend")])
    _check_launch(get)
    return out


def _check_launch(get: Vissl) -> None:
    """VISSL starts NUM_NODES x NUM_PROC_PER_NODE processes itself; memfit runs as many as were launched.
    Say so once when the two differ (the config's numbers still set auto_lr_scaling's global batch)."""
    nodes, per_node = get("DISTRIBUTED.NUM_NODES"), get("DISTRIBUTED.NUM_PROC_PER_NODE")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if nodes * per_node != launched:
        launch = f"memfit train CFG --gpus {per_node}" + (f" --nnodes {nodes}" if nodes > 1 else "")
        warn_ignored(f"VISSL keys config.DISTRIBUTED.NUM_NODES={nodes}, NUM_PROC_PER_NODE={per_node}",
                     f"processes come from the launch (this run has {launched}): start {nodes * per_node} with "
                     f"`{launch}` or torchrun; the numbers still set auto_lr_scaling's global batch")
    device = get("MACHINE.DEVICE")
    if device == "cpu":
        import torch

        if torch.cuda.is_available():
            warn_ignored("VISSL key config.MACHINE.DEVICE='cpu'", "memfit trains on CUDA when it is available: "
                                                                  "set CUDA_VISIBLE_DEVICES='' for the CPU")
    elif device != "gpu":
        raise refuse("MACHINE.DEVICE", device, "use gpu or cpu")
