"""Every VISSL config key memfit knows, with its status, VISSL's default and the memfit setting.

Status, per key (docs/vissl.md prints this table):

- ``supported``: translated to the memfit setting named in the note;
- ``warned``: has no effect in memfit; a value other than VISSL's default logs one warning saying why;
- ``refused``: memfit cannot do it; a value other than VISSL's default is a one-line ConfigError
  naming the key and what to use instead;
- ``inert``: VISSL itself does not use it for training (settings of other engines, of losses, trunks
  or meters that the config does not select), so it is accepted and ignored.

A path ending in ``.*`` covers everything below it that has no entry of its own. Values equal to
the default never warn or fail: a config may spell out VISSL's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.config.schema import suggest
from memfit.errors import ConfigError, warn_ignored

SUPPORTED, WARNED, REFUSED, INERT = "supported", "warned", "refused", "inert"
MISSING: Any = object()  # no default (the key has none in VISSL's defaults.yaml)


@dataclass(frozen=True)
class Key:
    """One VISSL key: ``status``, the memfit setting or reason (``note``), VISSL's ``default`` and
    whether a dict value is one value (``leaf``) rather than a section of keys."""

    status: str
    note: str
    default: Any = MISSING
    leaf: bool = False

    def harmless(self, value: Any) -> bool:
        """A warned or refused key set to VISSL's default asks for nothing memfit lacks."""
        return self.default is not MISSING and value == self.default


def _s(note: str, default: Any = MISSING, leaf: bool = False) -> Key:
    return Key(SUPPORTED, note, default, leaf=leaf)


def _w(note: str, default: Any = MISSING) -> Key:
    return Key(WARNED, note, default)


def _r(note: str, default: Any = MISSING) -> Key:
    return Key(REFUSED, note, default)


def _i(note: str, default: Any = MISSING) -> Key:
    return Key(INERT, note, default, leaf=True)


_OTHER_ENGINE = "a setting of another VISSL engine (feature extraction, benchmarks), not of training"
_SELECT = "used only when selected by {}"

KEYS: dict[str, Key] = {
    # -- global -----------------------------------------------------------------------------------------
    "VERBOSE": _s("log_level='DEBUG' when true", False),
    "LOG_FREQUENCY": _s("default_hooks.logger.interval", 10),
    "TEST_ONLY": _r("evaluate a checkpoint with `memfit eval CFG --checkpoint FILE`", False),
    "TEST_MODEL": _s("validation on (val_dataloader, val_evaluator, val_cfg from DATA.TEST and METERS) or off", True),
    "TEST_EVERY_NUM_EPOCH": _s("train_cfg.val_interval", 1),
    "SEED_VALUE": _s("randomness.seed", 0),
    "MULTI_PROCESSING_METHOD": _i("processes are started by torchrun (`memfit train CFG --gpus N`)", "forkserver"),
    "REPRODUCIBILITY.CUDDN_DETERMINISTIC": _s("randomness.deterministic", False),
    "VERSION": _i("VISSL's config version", 1),
    # -- hooks ------------------------------------------------------------------------------------------
    "HOOKS.PERF_STATS.MONITOR_PERF_STATS": _w("the log line carries time and data_time", False),
    "HOOKS.PERF_STATS.PERF_STAT_FREQUENCY": _w("the log line carries time and data_time", -1),
    "HOOKS.PERF_STATS.ROLLING_BTIME_FREQ": _w("time is averaged over the logger's window", -1),
    "HOOKS.MEMORY_SUMMARY.PRINT_MEMORY_SUMMARY": _i("the log line carries memory; cfg.memory_monitor adds a breakdown",
                                                    True),
    "HOOKS.MEMORY_SUMMARY.LOG_ITERATION_NUM": _i("see PRINT_MEMORY_SUMMARY", 0),
    "HOOKS.MEMORY_SUMMARY.DUMP_MEMORY_ON_EXCEPTION": _w("memfit does not dump tensors on an exception", False),
    "HOOKS.LOG_GPU_STATS": _i("the log line carries memory", True),
    "HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY": _w("no FLOP counter; `memfit plan CFG` predicts memory", False),
    "HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE": _i("see COMPUTE_COMPLEXITY", [3, 224, 224]),
    "HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD": _s("visualizer with TensorboardVisBackend", False),
    "HOOKS.TENSORBOARD_SETUP.LOG_DIR": _w("TensorBoard events go to work_dir/<timestamp>/tensorboard", "."),
    "HOOKS.TENSORBOARD_SETUP.EXPERIMENT_LOG_DIR": _w("TensorBoard events go to work_dir/<timestamp>/tensorboard",
                                                     "tensorboard"),
    "HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN": _i("events are flushed at every log line", 5),
    "HOOKS.TENSORBOARD_SETUP.LOG_PARAMS": _w("memfit logs scalars only, not parameter histograms", False),
    "HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_GRADIENTS": _w("memfit logs scalars only (grad_norm with clipping)", False),
    "HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS": _i("see LOG_PARAMS", 310),
    "MONITORING.MONITOR_ACTIVATION_STATISTICS": _w("no activation statistics monitor", 0),
    "PROFILING.RUNTIME_PROFILING.USE_PROFILER": _w("run torch.profiler around `memfit train` yourself", False),
    "PROFILING.MEMORY_PROFILING.TRACK_BY_LAYER_MEMORY": _w("`memfit plan CFG` and cfg.memory_monitor measure memory",
                                                           False),
    "PROFILING.*": _i("profiler options (see USE_PROFILER)"),
    # -- data -------------------------------------------------------------------------------------------
    "DATA.NUM_DATALOADER_WORKERS": _s("*_dataloader.num_workers", 4),
    "DATA.PIN_MEMORY": _s("*_dataloader.pin_memory (set only when given: pinning needs CUDA)", True),
    "DATA.ENABLE_ASYNC_GPU_COPY": _i("a speed option; batches are moved by the data preprocessor", True),
    "DATA.DDP_BUCKET_CAP_MB": _s("strategy=dict(type='DDPStrategy', bucket_cap_mb=N) when not 25", 25),
    # -- meters -----------------------------------------------------------------------------------------
    "METERS.name": _s("val_evaluator: accuracy_list_meter -> Accuracy", ""),
    "METERS.names": _s("val_evaluator, as METERS.name", []),
    "METERS.enable_training_meter": _w("memfit computes metrics on the validation data only", False),
    "METERS.accuracy_list_meter.num_meters": _s("one meter (several need several outputs: refused)", 1),
    "METERS.accuracy_list_meter.topk_values": _s("val_evaluator.topk", [1]),
    "METERS.accuracy_list_meter.meter_names": _i("names of several meters", []),
    "METERS.*": _i(_SELECT.format("METERS.name")),
    "MACHINE.DEVICE": _s("memfit uses CUDA when available, else the CPU", "gpu"),
    # -- model ------------------------------------------------------------------------------------------
    "MODEL.CUDA_CACHE.CLEAR_CUDA_CACHE": _w("the caching allocator is left alone", False),
    "MODEL.CUDA_CACHE.CLEAR_FREQ": _i("see CLEAR_CUDA_CACHE", 100),
    "MODEL.NON_TRAINABLE_PARAMS": _r("set requires_grad=False in a model subclass, or paramwise_cfg.custom_keys "
                                     "with lr_mult=0, decay_mult=0", []),
    "MODEL.TEMP_FROZEN_PARAMS_ITER_MAP": _r("freeze parameters from a custom hook", []),
    "MODEL.INPUT_TYPE": _r("the model takes RGB; convert in a transform", "rgb"),
    "MODEL.MULTI_INPUT_HEAD_MAPPING": _r("one input per model; write a BaseModel for several", []),
    "MODEL.SINGLE_PASS_EVERY_CROP": _i("multi-crop setting (multi-crop is refused)", False),
    "MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING":
        _s("cfg.activation_checkpointing=dict(splits=N, module='trunk')", False),
    "MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS":
        _s("N in cfg.activation_checkpointing=dict(splits=N, module='trunk')", 2),
    "MODEL.SHARDED_DDP_SETUP.USE_SDP": _r("ZeRO-2: strategy='deepspeed_stage_2' or 'fsdp_shard_grad_op'", False),
    "MODEL.SHARDED_DDP_SETUP.reduce_buffer_size": _i("see USE_SDP", -1),
    "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP": _r("strategy='fsdp' (FSDPStrategy)", False),
    "MODEL.FSDP_CONFIG.*": _i("FSDP options (FSDP is refused: strategy='fsdp')"),
    "MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON": _r("linear evaluation is not translated; freeze the trunk with "
                                                   "paramwise_cfg.custom_keys={'trunk': dict(lr_mult=0, decay_mult=0)}",
                                                   False),
    "MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY": _r("see EVAL_MODE_ON", False),
    "MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD": _r("see EVAL_MODE_ON", False),
    "MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY": _r("see EVAL_MODE_ON", False),
    "MODEL.FEATURE_EVAL_SETTINGS.EVAL_TRUNK_AND_HEAD": _r("see EVAL_MODE_ON", False),
    "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP": _r("see EVAL_MODE_ON", []),
    "MODEL.FEATURE_EVAL_SETTINGS.SHOULD_FLATTEN_FEATS": _i("see EVAL_MODE_ON", True),
    "MODEL.GRAD_CLIP.USE_GRAD_CLIP": _s("optim_wrapper.clip_grad", False),
    "MODEL.GRAD_CLIP.NORM_TYPE": _s("optim_wrapper.clip_grad.norm_type", 2),
    "MODEL.GRAD_CLIP.MAX_NORM": _s("optim_wrapper.clip_grad.max_norm", 1),
    "MODEL.TRUNK.NAME": _s("model.trunk.name: resnet, regnet, vision_transformer", "resnet"),
    "MODEL.TRUNK.RESNETS.DEPTH": _s("model.trunk.depth (18, 34, 50, 101, 152, 200)", 50),
    "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER": _s("model.trunk.width_multiplier", 1),
    "MODEL.TRUNK.RESNETS.NORM": _s("model.trunk.norm: BatchNorm or GroupNorm", "BatchNorm"),
    "MODEL.TRUNK.RESNETS.GROUPNORM_GROUPS": _s("model.trunk.groupnorm_groups", 32),
    "MODEL.TRUNK.RESNETS.STANDARDIZE_CONVOLUTIONS": _r("weight-standardised convolutions are not in memfit", False),
    "MODEL.TRUNK.RESNETS.GROUPS": _s("model.trunk.groups", 1),
    "MODEL.TRUNK.RESNETS.ZERO_INIT_RESIDUAL": _s("model.trunk.zero_init_residual", False),
    "MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP": _s("model.trunk.width_per_group", 64),
    "MODEL.TRUNK.RESNETS.LAYER4_STRIDE": _s("model.trunk.layer4_stride", 2),
    "MODEL.TRUNK.REGNET": _s("model.trunk: name (regnet_y_400mf, ...) or depth, w_0, w_a, w_m, group_width, ...", {},
                             leaf=True),
    "MODEL.TRUNK.VISION_TRANSFORMERS.name": _s("model.trunk preset: vit_b_32, vit_b_16, vit_l_32, vit_l_16, vit_h_14",
                                               None),
    "MODEL.TRUNK.VISION_TRANSFORMERS.IMAGE_SIZE": _s("model.trunk.image_size", 224),
    "MODEL.TRUNK.VISION_TRANSFORMERS.PATCH_SIZE": _s("model.trunk.patch_size", 16),
    "MODEL.TRUNK.VISION_TRANSFORMERS.NUM_LAYERS": _s("model.trunk.num_layers", 12),
    "MODEL.TRUNK.VISION_TRANSFORMERS.NUM_HEADS": _s("model.trunk.num_heads", 12),
    "MODEL.TRUNK.VISION_TRANSFORMERS.HIDDEN_DIM": _s("model.trunk.hidden_dim", 768),
    "MODEL.TRUNK.VISION_TRANSFORMERS.MLP_DIM": _s("model.trunk.mlp_dim", 3072),
    "MODEL.TRUNK.VISION_TRANSFORMERS.DROPOUT_RATE": _s("model.trunk.dropout_rate", 0),
    "MODEL.TRUNK.VISION_TRANSFORMERS.ATTENTION_DROPOUT_RATE": _s("model.trunk.attention_dropout_rate", 0),
    "MODEL.TRUNK.VISION_TRANSFORMERS.CLASSIFIER": _s("model.trunk.classifier: token or gap", "token"),
    "MODEL.TRUNK.VISION_TRANSFORMERS.DROP_PATH_RATE": _s("model.trunk.drop_path_rate", 0),
    "MODEL.TRUNK.VISION_TRANSFORMERS.QKV_BIAS": _s("model.trunk.qkv_bias", False),
    "MODEL.TRUNK.VISION_TRANSFORMERS.QK_SCALE": _r("timm's attention scales by head_dim ** -0.5 only", False),
    "MODEL.TRUNK.*": _i(_SELECT.format("MODEL.TRUNK.NAME")),
    "MODEL.HEAD.PARAMS": _s("model.heads: [['mlp', {...}], ['eval_mlp', {...}]] applied in order", [], leaf=True),
    "MODEL.HEAD.BATCHNORM_EPS": _s("model.head_bn_eps", 1e-5),
    "MODEL.HEAD.BATCHNORM_MOMENTUM": _s("model.head_bn_momentum", 0.1),
    "MODEL.HEAD.PARAMS_MULTIPLIER": _s("model.head_params_multiplier", 1.0),
    "MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN": _r("SyncBatchNorm is not in memfit yet", False),
    "MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE": _i("see CONVERT_BN_TO_SYNC_BN", "pytorch"),
    "MODEL.SYNC_BN_CONFIG.GROUP_SIZE": _i("see CONVERT_BN_TO_SYNC_BN", -1),
    "MODEL.AMP_PARAMS.USE_AMP": _s("O1: optim_wrapper AmpOptimWrapper; O2/O3: precision=dict(opt_level=...)", False),
    "MODEL.AMP_PARAMS.AMP_ARGS": _s("opt_level, keep_batchnorm_fp32, master_weights, loss_scale", {"opt_level": "O1"},
                                    leaf=True),
    "MODEL.AMP_PARAMS.AMP_TYPE": _s("apex: by opt_level; pytorch: AmpOptimWrapper (autocast)", "apex"),
    "MODEL.WEIGHTS_INIT.PARAMS_FILE": _r("VISSL's checkpoint layout is not read: give a memfit or plain state-dict "
                                         "file as load_from", ""),
    "MODEL.WEIGHTS_INIT.*": _i("see PARAMS_FILE"),
    "MODEL._MODEL_INIT_SEED": _i("filled in by VISSL from SEED_VALUE"),
    "DISTILLATION.*": _i("settings of VISSL's distillation engine"),
    # -- loss -------------------------------------------------------------------------------------------
    "LOSS.name": _s("model.loss: cross_entropy_multiple_output_single_target or CrossEntropyLoss",
                    "CrossEntropyLoss"),
    "LOSS.CrossEntropyLoss": _s("model.loss (ignore_index, weight, reduction, label_smoothing)", {"ignore_index": -1},
                                leaf=True),
    "LOSS.cross_entropy_multiple_output_single_target": _s("model.loss (weight, reduction, ignore_index, "
                                                           "normalize_output, temperature)", {}, leaf=True),
    "LOSS.*": _i(_SELECT.format("LOSS.name")),
    # -- optimizer --------------------------------------------------------------------------------------
    "OPTIMIZER.name": _s("optim_wrapper.optimizer.type: sgd -> SGD, adam -> Adam, adamw -> AdamW; zero -> "
                         "strategy=dict(type='DDPStrategy', zero=True) over base_optimizer", "sgd"),
    "OPTIMIZER.base_optimizer": _s("the optimizer under ZeRO (name: zero), read like OPTIMIZER itself", {}, leaf=True),
    "OPTIMIZER.use_zero": _s("strategy=dict(type='DDPStrategy', zero=True)", False),
    "OPTIMIZER.use_larc": _s("optimizer type='Larc' (Apex's LARC rule) with larc_config", False),
    "OPTIMIZER.larc_config.clip": _s("optimizer.clip", False),
    "OPTIMIZER.larc_config.eps": _s("optimizer.eps", 1e-8),
    "OPTIMIZER.larc_config.trust_coefficient": _s("optimizer.trust_coefficient", 0.001),
    "OPTIMIZER.weight_decay": _s("optimizer.weight_decay", 0.0001),
    "OPTIMIZER.momentum": _s("optimizer.momentum (sgd)", 0.9),
    "OPTIMIZER.nesterov": _s("optimizer.nesterov (sgd)", False),
    "OPTIMIZER.betas": _s("optimizer.betas (adam, adamw)", [0.9, 0.999]),
    "OPTIMIZER.eps": _s("optimizer.eps (adam, adamw)", 1e-8),
    "OPTIMIZER.amsgrad": _s("optimizer.amsgrad (adam, adamw)", False),
    "OPTIMIZER.num_epochs": _s("train_cfg.max_epochs (and the schedules' num_epochs)", 90),
    "OPTIMIZER.regularize_bn": _s("false: paramwise_cfg.norm_decay_mult=0", False),
    "OPTIMIZER.regularize_bias": _s("false: paramwise_cfg.bias_decay_mult=0", True),
    "OPTIMIZER.non_regularized_parameters": _s("paramwise_cfg.custom_keys={name: dict(decay_mult=0)}", []),
    "OPTIMIZER.head_optimizer_params.use_different_lr": _r("one lr schedule per run: give the heads an lr multiple "
                                                           "with paramwise_cfg.custom_keys={'heads': dict(lr_mult=k)}",
                                                           False),
    "OPTIMIZER.head_optimizer_params.use_different_wd": _s("paramwise_cfg.custom_keys={'heads': dict(decay_mult=...)}",
                                                           False),
    "OPTIMIZER.head_optimizer_params.weight_decay": _s("the heads' weight decay (with use_different_wd)", 0.0001),
    "OPTIMIZER.param_schedulers.lr": _s("param_scheduler=dict(type='VisslLR', ...): the same schedule, per step or "
                                        "epoch; auto_lr_scaling applied as VISSL does", {}, leaf=True),
    "OPTIMIZER.param_schedulers.lr_head": _i(_SELECT.format("head_optimizer_params.use_different_lr (refused)")),
    "OPTIMIZER.construct_single_param_group_only": _s("true: no paramwise_cfg (one group)", False),
    # -- other engines ----------------------------------------------------------------------------------
    "EXTRACT_FEATURES.*": _i(_OTHER_ENGINE),
    "CLUSTERFIT.*": _i(_OTHER_ENGINE),
    "SVM.*": _i(_OTHER_ENGINE),
    "IMG_RETRIEVAL.*": _i(_OTHER_ENGINE),
    "NEAREST_NEIGHBOR.*": _i(_OTHER_ENGINE),
    "TRAINER.TRAIN_STEP_NAME": _r("the model's own train_step runs; override BaseModel.train_step",
                                  "standard_train_step"),
    "TRAINER.TASK_NAME": _r("for self_supervision_fsdp_task use strategy='fsdp'", "self_supervision_task"),
    # -- checkpoints ------------------------------------------------------------------------------------
    "CHECKPOINT.DIR": _s("work_dir (default: work_dirs/<config name>)", "."),
    "CHECKPOINT.APPEND_DISTR_RUN_ID": _w("the work dir is used as given", False),
    "CHECKPOINT.BACKEND": _r("checkpoints are local files; copy them with default_hooks.checkpoint.out_dir", "disk"),
    "CHECKPOINT.AUTO_RESUME": _s("resume=True (latest checkpoint in the work dir, if any)", True),
    "CHECKPOINT.CHECKPOINT_FREQUENCY": _s("default_hooks.checkpoint.interval (epochs)", 1),
    "CHECKPOINT.CHECKPOINT_ITER_FREQUENCY": _s("custom_hooks: a CheckpointHook(by_epoch=False, interval=N)", -1),
    "CHECKPOINT.OVERWRITE_EXISTING": _w("a finished run resumes as finished: use a new work dir to train again", False),
    "CHECKPOINT.LATEST_CHECKPOINT_RESUME_FILE_NUM": _r("resume from an older checkpoint with `--resume FILE`", 1),
    "CHECKPOINT.USE_SYMLINK_CHECKPOINT_FOR_RESUME": _i("work_dir/last_checkpoint always names the latest", False),
    # -- distributed ------------------------------------------------------------------------------------
    "DISTRIBUTED.BACKEND": _s("env_cfg.dist_cfg.backend", "nccl"),
    "DISTRIBUTED.NCCL_DEBUG": _w("set NCCL_DEBUG=INFO in the environment", False),
    "DISTRIBUTED.NCCL_SOCKET_NTHREADS": _w("set NCCL_SOCKET_NTHREADS in the environment", ""),
    "DISTRIBUTED.BROADCAST_BUFFERS": _s("strategy=dict(type='DDPStrategy', broadcast_buffers=False) when false", True),
    "DISTRIBUTED.NUM_NODES": _s("start with `memfit train CFG --gpus N --nnodes M`; the global batch of "
                                "auto_lr_scaling", 1),
    "DISTRIBUTED.NUM_PROC_PER_NODE": _s("start with `memfit train CFG --gpus N`; the global batch of "
                                        "auto_lr_scaling", 8),
    "DISTRIBUTED.INIT_METHOD": _i("processes join through torchrun's rendezvous", "tcp"),
    "DISTRIBUTED.RUN_ID": _i("use --master-port or --rdzv-endpoint", "auto"),
    "DISTRIBUTED.MANUAL_GRADIENT_REDUCTION": _w("memfit's DDP reduces gradients in buckets during backward, which "
                                                "non-reentrant activation checkpointing does not disturb", False),
    "SLURM.USE_SLURM": _r("submit `srun memfit train CFG --launcher slurm` with your own sbatch script", False),
    "SLURM.*": _i("see USE_SLURM"),
}

_SPLIT_KEYS: dict[str, Key] = {
    "USE_DEBUGGING_SAMPLER": _r("the sampler is memfit's DefaultSampler", False),
    "USE_STATEFUL_DISTRIBUTED_SAMPLER": _s("sampler=dict(type='DefaultSampler'): rank-sharded, resumes mid-epoch "
                                           "(memfit's sampler always is)", False),
    "DROP_LAST": _s("*_dataloader.drop_last", False),
    "REMOVE_IMG_PATH_PREFIX": _r("file lists are not read: use an ImageFolder layout", ""),
    "NEW_IMG_PATH_PREFIX": _r("file lists are not read: use an ImageFolder layout", ""),
    "BASE_DATASET": _r("memfit's datasets are built directly", "generic_ssl"),
    "DATASET_NAMES": _i("names in VISSL's dataset catalog; memfit reads DATA_PATHS", ["imagenet1k_folder"]),
    "DATA_SOURCES": _s("synthetic -> ShapesDataset, disk_folder -> ImageFolder", []),
    "DATA_PATHS": _s("ImageFolder root (disk_folder)", []),
    "LABEL_SOURCES": _s("the same source as DATA_SOURCES (labels come with the images)", []),
    "LABEL_PATHS": _r("labels come from the class folders (disk_folder)", []),
    "LABEL_TYPE": _s("standard (class labels); sample_index and zero are refused", "standard"),
    "MMAP_MODE": _i("file-list option", True),
    "DEFAULT_GRAY_IMG_SIZE": _s("ShapesDataset.image_size (synthetic)", 224),
    "BATCHSIZE_PER_REPLICA": _s("*_dataloader.batch_size", 256),
    "TRANSFORMS": _s("dataset transform: torchvision.transforms.v2 names; ToTensor -> ToDtype(float32, scale=True)",
                     [], leaf=True),
    "COLLATE_FUNCTION": _r("only default_collate; multi-crop and mixup collators are not in memfit", "default_collate"),
    "COLLATE_FUNCTION_PARAMS": _r("see COLLATE_FUNCTION", {}),
    "DATA_LIMIT": _s("ShapesDataset.num_samples (synthetic; default 50000 as VISSL's)", -1),
    "DATA_LIMIT_SAMPLING.SEED": _i("see DATA_LIMIT", 0),
    "DATA_LIMIT_SAMPLING.IS_BALANCED": _r("sub-sample the folder yourself", False),
    "DATA_LIMIT_SAMPLING.SKIP_NUM_SAMPLES": _r("sub-sample the folder yourself", 0),
    "COPY_TO_LOCAL_DISK": _r("copy the data before training", False),
    "COPY_DESTINATION_DIR": _i("see COPY_TO_LOCAL_DISK", ""),
    "INPUT_KEY_NAMES": _r("batches are {'img', 'label'} dicts", ["data"]),
    "TARGET_KEY_NAMES": _r("batches are {'img', 'label'} dicts", ["label"]),
    "ENABLE_QUEUE_DATASET": _r("a file that cannot be read is an error", False),
    "RANDOM_SYNTHETIC_IMAGES": _i("memfit's synthetic images are always drawn shapes", False),
    "RANDOM_SYNTHETIC_LABELS": _s("ShapesDataset.num_classes (at most 10; default: the head's outputs, at most 10)", 0),
}
for _split in ("TRAIN", "TEST"):
    KEYS.update({f"DATA.{_split}.{k}": v for k, v in _SPLIT_KEYS.items()})

# Keys of OPTIMIZER.base_optimizer (ZeRO's inner optimizer), checked as OPTIMIZER's own.
BASE_OPTIMIZER_KEYS = ("name", "use_larc", "larc_config", "weight_decay", "momentum", "nesterov", "betas", "eps",
                       "amsgrad")


class Vissl:
    """The keys a file gives (dotted, relative to ``config``); calling it reads a key, VISSL's default
    when the file leaves it out."""

    def __init__(self, given: dict[str, Any]) -> None:
        self.given = given

    def __call__(self, path: str) -> Any:
        return self.given[path] if path in self.given else KEYS[path].default

    def __contains__(self, path: str) -> bool:
        return path in self.given


def as_int(value: Any, key: str, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``, else a ConfigError naming VISSL's ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"VISSL key config.{key}={value!r}: must be an int >= {minimum}")
    return value


def refuse(key: str, value: Any, why: str) -> ConfigError:
    """The one-line error for a VISSL setting memfit cannot run: the key, the value and what to do."""
    return ConfigError(f"VISSL key config.{key}={value!r} is not supported by memfit: {why}")


def lookup(path: str) -> Key | None:
    """The entry for a dotted path: its own, else the nearest ``.*`` entry above it."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        spec = KEYS.get(".".join(parts[:n]) + ".*")
        if spec is not None:
            return spec
    return None


def _is_section(path: str) -> bool:
    return any(k.startswith(path + ".") for k in KEYS)


def check_keys(cfg: Mapping[str, Any], prefix: str = "", given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Walk a VISSL ``config`` mapping: an unknown key or a refused setting is a ConfigError naming it,
    a setting with no effect warns once. Returns ``{dotted path: value}`` of every key given."""
    given = {} if given is None else given
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if path not in KEYS and _is_section(path) and (value is None or isinstance(value, Mapping)):
            check_keys(value or {}, path + ".", given)  # an empty section (`HOOKS:`) is YAML's None
            continue
        spec = lookup(path)
        if spec is None:
            siblings = {k[len(prefix):].split(".")[0] for k in KEYS if k.startswith(prefix)} - {"*"}
            raise ConfigError(f"unknown VISSL key 'config.{path}': {suggest(str(key), siblings)}")
        given[path] = value
        if spec.status == REFUSED and not spec.harmless(value):
            raise refuse(path, value, spec.note)
        if spec.status == WARNED and not spec.harmless(value):
            warn_ignored(f"VISSL key config.{path}", spec.note)
    return given
