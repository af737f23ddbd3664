"""Validation: top-level keys with suggestions, typed sections with defaults and one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from memfit.config import (
    CONFIG_KEYS,
    RUNNER_KEYS,
    TECHNIQUE_KEYS,
    DataloaderCfg,
    EnvCfg,
    Randomness,
    TestCfg,
    TrainCfg,
    ValCfg,
    validate_config,
)
from memfit.errors import ConfigError

# The FlexibleRunner call from the seeds (mmengine_training_big_models.md, mmengine_save_memory_en.md).
SEED_RUNNER_CFG = dict(
    model=dict(type="ToyModel"),
    work_dir="./work_dirs",
    strategy=dict(type="FSDPStrategy"),
    optim_wrapper=dict(type="AmpOptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)),
    param_scheduler=dict(type="LinearLR"),
    train_dataloader=DataLoader([(torch.ones(1, 1), torch.ones(1, 1))] * 4, batch_size=2),
    train_cfg=dict(by_epoch=True, max_epochs=10, val_interval=1),
    val_dataloader=dict(batch_size=2, dataset=dict(type="ShapesDataset")),
    val_cfg=dict(),
    val_evaluator=dict(type="Accuracy"),
    cfg=dict(
        activation_checkpointing=["backbone.layers.0"],
        efficient_conv_bn_eval=["backbone"],
        model_wrapper_cfg=dict(type="MMFullyShardedDataParallel", cpu_offload=True),
    ),
)


def test_seed_runner_arguments_validate():
    validate_config(SEED_RUNNER_CFG)


def test_key_lists_are_disjoint_and_complete():
    from memfit.config.schema import HELPER_KEYS

    assert len(set(CONFIG_KEYS)) == len(CONFIG_KEYS) == len(RUNNER_KEYS) + len(TECHNIQUE_KEYS) + len(HELPER_KEYS)
    validate_config({k: None for k in CONFIG_KEYS})
    validate_config({"_helper": 1, "_base_": "x.py"})  # helpers are allowed


def test_unknown_top_level_key_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        validate_config({"trian_cfg": dict(max_epochs=1)})
    assert str(e.value) == (
        "unknown config key 'trian_cfg': did you mean 'train_cfg'? (helper variables must start with '_')"
    )
    # The seed's `optim_wrapper_cfg = dict(...)` snippet is not a Runner argument.
    with pytest.raises(ConfigError, match="'optim_wrapper_cfg': did you mean 'optim_wrapper'"):
        validate_config({"optim_wrapper_cfg": dict(type="OptimWrapper")})


def test_unknown_key_inside_runner_cfg_is_named_with_its_path():
    with pytest.raises(
        ConfigError, match="'cfg.activation_checkpointng': did you mean 'activation_checkpointing'"
    ):
        validate_config({"cfg": {"activation_checkpointng": ["backbone"]}})


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"train_cfg": dict(max_epoch=2)},
            r"^unknown config key 'train_cfg.max_epoch': did you mean 'max_epochs'\?$",
        ),
        ({"val_cfg": dict(fp61=True)}, r"'val_cfg.fp61': did you mean 'fp16'"),
        ({"test_cfg": dict(typ="TestLoop")}, r"'test_cfg.typ': did you mean 'type'"),
        ({"env_cfg": dict(cudnn_benchmrk=True)}, r"'env_cfg.cudnn_benchmrk': did you mean 'cudnn_benchmark'"),
        ({"randomness": dict(sed=0)}, r"'randomness.sed': did you mean 'seed'"),
        (
            {"val_dataloader": dict(dataset={}, batch_sze=2)},
            r"'val_dataloader.batch_sze': did you mean 'batch_size'",
        ),
        ({"cfg": {"train_cfg": dict(max_itres=2)}}, r"'cfg.train_cfg.max_itres': did you mean 'max_iters'"),
    ],
)
def test_misspelt_section_key_names_key_subkey_and_nearest_field(cfg, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_train_cfg_defaults_and_loop_types():
    assert TrainCfg.from_dict(dict(max_epochs=3), "train_cfg") == TrainCfg(max_epochs=3)
    epoch = TrainCfg.from_dict(dict(type="EpochBasedTrainLoop", max_epochs=2), "train_cfg")
    assert epoch.by_epoch and epoch.val_interval == 1 and epoch.val_begin == 1
    it = TrainCfg.from_dict(dict(type="IterBasedTrainLoop", max_iters=100, val_interval=50), "train_cfg")
    assert (it.by_epoch, it.max_iters, it.max_epochs, it.val_interval) == (False, 100, None, 50)
    assert TrainCfg.from_dict(dict(by_epoch=False, max_iters=5), "train_cfg").type is None


@pytest.mark.parametrize(
    "d, message",
    [
        (None, r"train_cfg.max_epochs is required with by_epoch=True"),
        (dict(by_epoch=False), r"train_cfg.max_iters is required with by_epoch=False"),
        (dict(type="IterBasedTrainLoop", max_epochs=2), r"train_cfg.max_iters is required"),
        (dict(max_epochs=2, max_iters=10), r"train_cfg.max_iters does not apply with by_epoch=True"),
        (dict(type="IterBasedTrainLoop", by_epoch=True, max_iters=3), r"contradicts by_epoch=True"),
        (dict(type="EpochBasedLoop", max_epochs=1), r"not a train loop: did you mean 'EpochBasedTrainLoop'"),
        (dict(max_epochs="12"), r"train_cfg.max_epochs must be int or None, got str '12'"),
        (dict(max_epochs=True), r"train_cfg.max_epochs must be int or None, got bool"),
        (dict(by_epoch="yes", max_epochs=1), r"train_cfg.by_epoch must be bool"),
        (dict(max_epochs=0), r"train_cfg.max_epochs must be >= 1, got 0"),
        (dict(max_epochs=2, val_interval=0), r"train_cfg.val_interval must be >= 1"),
        ([1, 2], r"train_cfg must be a dict, got list"),
    ],
)
def test_train_cfg_errors(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainCfg.from_dict(d, "train_cfg")


def test_other_sections_fill_defaults():
    assert ValCfg.from_dict(None, "val_cfg") == ValCfg(type=None, fp16=False)
    assert TestCfg.from_dict(dict(fp16=True), "test_cfg").fp16
    env = EnvCfg.from_dict(dict(dist_cfg=dict(backend="gloo")), "env_cfg")
    assert env == EnvCfg(cudnn_benchmark=False, mp_cfg=None, dist_cfg={"backend": "gloo"})
    assert Randomness.from_dict(dict(seed=0), "randomness") == Randomness(seed=0, deterministic=False)
    loader = DataloaderCfg.from_dict(dict(dataset=dict(type="ShapesDataset")), "train_dataloader")
    assert (loader.batch_size, loader.num_workers, loader.sampler) == (1, None, None)  # None: chosen for the device
    assert loader.to_dict()["dataset"] == {"type": "ShapesDataset"}


@pytest.mark.parametrize(
    "d, message",
    [
        (dict(batch_size=2), r"val_dataloader.dataset is required"),
        (dict(dataset={}, batch_size=0), r"val_dataloader.batch_size must be >= 1"),
        (dict(dataset={}, num_workers=-1), r"val_dataloader.num_workers must be >= 0"),
        (dict(dataset={}, pin_memory=1), r"val_dataloader.pin_memory must be bool or None, got int 1"),
    ],
)
def test_dataloader_errors_name_the_loader(d, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"val_dataloader": d})


def test_sections_are_checked_when_built_directly():
    with pytest.raises(ConfigError, match=r"randomness.seed must be int or None"):
        Randomness(seed="0")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"train_cfg.max_epochs is required"):
        TrainCfg()


def test_sections_that_are_objects_are_left_to_their_builders():
    validate_config({"train_dataloader": DataLoader([1, 2]), "train_cfg": None, "val_cfg": None})


def test_worker_only_options_allowed_without_workers():
    # A GPU config run with num_workers=0 keeps working: the loader builder drops these two.
    cfg = DataloaderCfg.from_dict(dict(dataset={}, num_workers=0, persistent_workers=True, prefetch_factor=2),
                                  "val_dataloader")
    assert cfg.num_workers == 0 and cfg.persistent_workers is True
