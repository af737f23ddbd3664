"""The config schema: which top-level keys exist, and typed dataclasses for fixed-shape sections.

This module is the one place that lists the keys the Runner accepts, so the runner imports
``RUNNER_KEYS``/``TECHNIQUE_KEYS`` from here and a misspelt key in a config file fails here, with
the nearest valid key, before anything is built. Sections whose contents are open-ended (model,
optimizer, hooks, schedulers) are checked later against the signature of the class they build.
"""

from __future__ import annotations

import contextvars
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean, nearest

# MMEngine's Runner and FlexibleRunner arguments, which are the top-level keys of a config file.
RUNNER_KEYS: tuple[str, ...] = (
    "model",
    "work_dir",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "train_cfg",
    "val_cfg",
    "test_cfg",
    "auto_scale_lr",
    "optim_wrapper",
    "param_scheduler",
    "val_evaluator",
    "test_evaluator",
    "default_hooks",
    "custom_hooks",
    "data_preprocessor",
    "load_from",
    "resume",
    "launcher",
    "env_cfg",
    "log_processor",
    "log_level",
    "visualizer",
    "default_scope",
    "randomness",
    "experiment_name",
    "strategy",
    "compile",
    "cfg",
    "precision",  # Apex's opt levels (VISSL's AMP_ARGS): memfit.precision.master.precision_options
)

# Memory techniques and speed levers a config may switch on at top level; the runner reads them from ``cfg``.
TECHNIQUE_KEYS: tuple[str, ...] = (
    "activation_checkpointing",
    "efficient_conv_bn_eval",
    "model_wrapper_cfg",
    "optimizer_in_backward",
    "optimizer_offload",
    "activation_offload",
    "memory_monitor",
    "auto_fit",  # dict(budget='24GiB', gpus=8): memfit.planner.autofit, applied by Runner.from_cfg
    "planner",  # dict(input_shape='2x3x800x1344'): what the planner plans for (memfit.planner.inputs)
    # Speed levers (memfit.speed), applied by memfit.connector.setup; compile is the Runner's own key above.
    "channels_last",  # True: NHWC weights and images (memfit.speed.channels_last)
    "tf32",  # True/False: TF32 for CUDA matmuls and cuDNN convolutions, process-wide (memfit.speed.tf32)
)

# MMEngine config variables that other keys are built from (``visualizer = dict(vis_backends=vis_backends)``);
# ``Runner.from_cfg`` reads ``vis_backends`` as the visualizer's when no ``visualizer`` is given.
# MMDetection's configs name these at top level too (``data_root``, the pipelines, ``max_epochs``, ...): they are
# accepted as they are, so those configs load unchanged; any other helper variable starts with '_'.
HELPER_KEYS: tuple[str, ...] = (
    "vis_backends", "data_root", "dataset_type", "backend_args", "train_pipeline", "test_pipeline", "val_pipeline",
    "max_epochs", "max_iters", "num_levels", "num_classes", "classes", "metainfo", "pretrained", "image_size",
    "batch_augments", "base_lr", "checkpoint",
    "fp16",  # MMDetection 2's AMP switch, left in some MMDetection 3 configs: read by nothing (Runner.from_cfg warns)
)

CONFIG_KEYS: tuple[str, ...] = RUNNER_KEYS + TECHNIQUE_KEYS + HELPER_KEYS

# The config key a section is being built for, so __post_init__'s checks name it in their errors.
_BUILDING_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("_BUILDING_KEY", default=None)


def suggest(name: str, candidates: typing.Iterable[str]) -> str:
    """``did you mean 'x'?`` with the single nearest candidate, or the list of valid names."""
    candidates = list(candidates)
    close = nearest(name, candidates, n=1)
    return f"did you mean {close[0]!r}?" if close else did_you_mean(name, candidates)


class Section:
    """Base of the typed sections: ``from_dict`` rejects unknown keys and wrong types, fills defaults."""

    # The config key used in messages when a section is built directly rather than by from_dict.
    KEY: ClassVar[str] = "section"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, key: str | None = None) -> Any:
        """Build the section from its config dict; ``key`` (e.g. ``'train_cfg'``) names it in errors.

        ``None`` means the section is absent: every field takes its default (and a section that has
        a required field reports it). A misspelt key raises ConfigError naming ``key.subkey`` and
        the nearest valid field.
        """
        key = key or cls.KEY
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ConfigTypeError(f"{key} must be a dict, got {type(d).__name__} {d!r}")
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        for sub in d:
            if sub not in names:
                raise ConfigError(f"unknown config key '{key}.{sub}': {suggest(str(sub), names)}")
        values = cls._prepare(dict(d), key)
        token = _BUILDING_KEY.set(key)
        try:
            return cls(**values)
        finally:
            _BUILDING_KEY.reset(token)

    @classmethod
    def _prepare(cls, values: dict[str, Any], key: str) -> dict[str, Any]:
        """Translate alternative spellings before construction (TrainCfg's loop ``type``)."""
        return values

    def check(self, key: str | None = None) -> None:
        """Raise ConfigError naming ``key.field`` if a field has the wrong type or value."""
        key = key or self.KEY
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not _is_instance(value, hints[f.name]):
                raise ConfigTypeError(
                    f"{key}.{f.name} must be {_type_name(hints[f.name])}, "
                    f"got {type(value).__name__} {value!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict (all fields, defaults included)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def __post_init__(self) -> None:
        self.check(_BUILDING_KEY.get())

    def _positive(self, key: str, *names: str, minimum: int = 1) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < minimum:
                raise ConfigError(f"{key}.{name} must be >= {minimum}, got {value}")


def _is_instance(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        return isinstance(value, origin)
    if hint is int:  # bool is an int subclass, but True is no epoch count
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


# MMEngine's loop names, which imply by_epoch.
TRAIN_LOOP_TYPES = {"EpochBasedTrainLoop": True, "IterBasedTrainLoop": False}


@dataclass
class TrainCfg(Section):
    """``train_cfg``: epoch- or iteration-based training length and validation schedule.

    ``type='EpochBasedTrainLoop'`` / ``'IterBasedTrainLoop'`` (MMEngine's spelling) set ``by_epoch``.
    Epoch-based training needs ``max_epochs``; iteration-based needs ``max_iters``. ``val_interval``
    and ``val_begin`` count epochs or iterations accordingly.
    """

    KEY: ClassVar[str] = "train_cfg"
    by_epoch: bool = True
    max_epochs: int | None = None
    max_iters: int | None = None
    val_interval: int = 1
    val_begin: int = 1
    type: str | None = None

    @classmethod
    def _prepare(cls, values: dict[str, Any], key: str) -> dict[str, Any]:
        loop = values.get("type")
        if isinstance(loop, str) and loop in TRAIN_LOOP_TYPES and "by_epoch" not in values:
            values["by_epoch"] = TRAIN_LOOP_TYPES[loop]
        return values

    def check(self, key: str | None = None) -> None:
        key = key or self.KEY
        super().check(key)
        if self.type is not None and self.type not in TRAIN_LOOP_TYPES:
            raise ConfigError(
                f"{key}.type {self.type!r} is not a train loop: {suggest(self.type, TRAIN_LOOP_TYPES)}"
            )
        if self.type is not None and TRAIN_LOOP_TYPES[self.type] != self.by_epoch:
            raise ConfigError(
                f"{key}: type={self.type!r} contradicts by_epoch={self.by_epoch}; set only one of them"
            )
        need, other = ("max_epochs", "max_iters") if self.by_epoch else ("max_iters", "max_epochs")
        mode = "by_epoch=True" if self.by_epoch else "by_epoch=False"
        if getattr(self, need) is None:
            raise ConfigError(f"{key}.{need} is required with {mode}: e.g. {key}=dict({mode}, {need}=12)")
        if getattr(self, other) is not None:
            raise ConfigError(
                f"{key}.{other} does not apply with {mode}: set {need} instead (or flip by_epoch)"
            )
        self._positive(key, "max_epochs", "max_iters", "val_interval", "val_begin")


@dataclass
class ValCfg(Section):
    """``val_cfg``: the validation loop (``type`` as MMEngine's ValLoop; ``fp16``: half precision)."""

    KEY: ClassVar[str] = "val_cfg"
    type: str | None = None
    fp16: bool = False


@dataclass
class TestCfg(ValCfg):
    """``test_cfg``: the test loop, same fields as ``val_cfg``."""

    __test__ = False  # not a pytest test class despite the name
    KEY: ClassVar[str] = "test_cfg"


@dataclass
class EnvCfg(Section):
    """``env_cfg``: cuDNN benchmark, multiprocessing settings and process-group options."""

    KEY: ClassVar[str] = "env_cfg"
    cudnn_benchmark: bool = False
    mp_cfg: dict | None = None
    dist_cfg: dict | None = None


@dataclass
class Randomness(Section):
    """``randomness``: the seed, deterministic algorithms, and a different seed per rank."""

    KEY: ClassVar[str] = "randomness"
    seed: int | None = None
    deterministic: bool = False
    diff_rank_seed: bool = False


@dataclass
class DataloaderCfg(Section):
    """``*_dataloader``: a dataset config (or object) plus ``torch.utils.data.DataLoader`` options.

    ``sampler``, ``batch_sampler`` and ``collate_fn`` are registry configs or objects. The checks
    here are the ones DataLoader itself would make later, raised where the bad value was written.
    """

    KEY: ClassVar[str] = "train_dataloader"
    batch_size: int = 1
    dataset: Any = None
    sampler: Any = None
    batch_sampler: Any = None
    collate_fn: Any = None
    num_workers: int | None = None  # None: memfit.data.loader.default_num_workers for the run's device
    persistent_workers: bool = False
    pin_memory: bool | None = None  # None: pinned when training on CUDA
    drop_last: bool = False
    prefetch_factor: int | None = None

    def check(self, key: str | None = None) -> None:
        key = key or self.KEY
        super().check(key)
        if self.dataset is None:
            raise ConfigError(
                f"{key}.dataset is required: e.g. {key}=dict(dataset=dict(type='ShapesDataset'), ...)"
            )
        self._positive(key, "batch_size", "prefetch_factor")
        self._positive(key, "num_workers", minimum=0)
        # persistent_workers/prefetch_factor with num_workers=0 are dropped by the loader builder, so a
        # GPU config run with `--cfg-options train_dataloader.num_workers=0` works unchanged.


SECTIONS: dict[str, type[Section]] = {
    "train_cfg": TrainCfg,
    "val_cfg": ValCfg,
    "test_cfg": TestCfg,
    "env_cfg": EnvCfg,
    "randomness": Randomness,
    "train_dataloader": DataloaderCfg,
    "val_dataloader": DataloaderCfg,
    "test_dataloader": DataloaderCfg,
}


SWITCHES = ("optimizer_offload", "optimizer_in_backward")  # technique keys that are on or off, nothing else


def validate_config(cfg: Mapping[str, Any]) -> None:
    """Check the top-level keys and every fixed-shape section that is present as a dict.

    An unknown key raises ConfigError with the nearest valid key; keys starting with ``_`` are
    helpers and allowed. A nested ``cfg`` (the Runner's ``cfg=`` argument, which may hold the
    technique keys or the whole config) is checked the same way.
    """
    _validate(cfg, "")


def _validate(cfg: Mapping[str, Any], prefix: str) -> None:
    if not isinstance(cfg, Mapping):
        raise ConfigTypeError(f"{prefix.rstrip('.') or 'config'} must be a dict, got {type(cfg).__name__}")
    for key, value in cfg.items():
        if not isinstance(key, str):
            raise ConfigTypeError(f"config key {key!r} in {prefix.rstrip('.') or 'the config'} must be a string")
        if key.startswith("_"):
            continue
        if key not in CONFIG_KEYS:
            raise ConfigError(
                f"unknown config key '{prefix}{key}': {suggest(key, CONFIG_KEYS)} "
                "(helper variables must start with '_')"
            )
        if key in SECTIONS and isinstance(value, Mapping):
            SECTIONS[key].from_dict(value, prefix + key)
        elif key == "precision" and value is not None:
            from memfit.precision.master import precision_options

            precision_options(value)
        elif key in SWITCHES and not isinstance(value, bool) and value is not None:  # 'yes' would read as on
            raise ConfigTypeError(f"{prefix}{key} must be True or False, got {type(value).__name__} {value!r}")
        elif key == "cfg" and isinstance(value, Mapping) and not prefix:
            _validate(value, "cfg.")
