"""VISSL configs (root key ``config:``) translated key by key: the memfit setting each key produces,
one-line errors for unknown and refused keys, one warning for keys with no effect."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from memfit import errors
from memfit.config import Config
from memfit.config.vissl import KEYS, REFUSED, WARNED, translate_vissl
from memfit.config.vissl.keys import MISSING
from memfit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIGS = ROOT / "configs" / "vissl"

# The smallest complete config: everything else comes from VISSL's defaults.
BASE = {
    "DATA": {"NUM_DATALOADER_WORKERS": 0,
             "TRAIN": {"DATA_SOURCES": ["synthetic"], "LABEL_SOURCES": ["synthetic"], "BATCHSIZE_PER_REPLICA": 4,
                       "DATA_LIMIT": 8, "DEFAULT_GRAY_IMG_SIZE": 32}},
    "MODEL": {"TRUNK": {"NAME": "resnet", "RESNETS": {"DEPTH": 18}}, "HEAD": {"PARAMS": [["mlp", {"dims": [512, 4]}]]}},
    "OPTIMIZER": {"num_epochs": 2, "param_schedulers": {"lr": {"name": "constant", "value": 0.1}}},
    "DISTRIBUTED": {"NUM_PROC_PER_NODE": 1},
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def vissl(**sections) -> dict:
    return translate_vissl({"config": _merge(BASE, sections)})


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(errors, "_WARNED", set())
    # As the runner sets it: caplog then sees each record once (through the handler conftest adds).
    monkeypatch.setattr(logging.getLogger("memfit"), "propagate", False)


# -- the seed's snippets -----------------------------------------------------------------------------------
def test_larc_snippet():
    cfg = vissl(OPTIMIZER={"name": "sgd", "use_larc": True,
                           "larc_config": {"clip": False, "eps": "1e-08", "trust_coefficient": 0.001}})
    assert cfg["optim_wrapper"]["optimizer"] == dict(type="Larc", lr=0.1, weight_decay=0.0001, momentum=0.9,
                                                     nesterov=False, clip=False, eps=1e-08, trust_coefficient=0.001)
    assert "strategy" not in cfg


def test_zero_snippet_shards_the_base_optimizer():
    base = {"name": "sgd", "use_larc": False, "larc_config": {"clip": False, "trust_coefficient": 0.001,
                                                              "eps": 0.00000001},
            "weight_decay": 0.000001, "momentum": 0.9, "nesterov": False}
    cfg = vissl(OPTIMIZER={"name": "zero", "base_optimizer": base})
    assert cfg["strategy"] == dict(type="DDPStrategy", zero=True)
    assert cfg["optim_wrapper"]["optimizer"] == dict(type="SGD", lr=0.1, weight_decay=1e-06, momentum=0.9,
                                                     nesterov=False)
    # LARC wraps the base optimizer under ZeRO too
    larc = vissl(OPTIMIZER={"name": "zero", "base_optimizer": {**base, "use_larc": True}})
    assert larc["optim_wrapper"]["optimizer"]["type"] == "Larc" and larc["strategy"]["zero"] is True
    assert vissl(OPTIMIZER={"use_zero": True})["strategy"] == dict(type="DDPStrategy", zero=True)


def test_amp_o1_is_autocast_and_o3_the_precision_entry():
    o1 = vissl(MODEL={"AMP_PARAMS": {"USE_AMP": True, "AMP_ARGS": {"opt_level": "O1"}}})
    assert o1["optim_wrapper"]["type"] == "AmpOptimWrapper" and o1["optim_wrapper"]["loss_scale"] == "dynamic"
    assert "dtype" not in o1["optim_wrapper"] and "precision" not in o1  # fp16 on CUDA, bf16 on native-bf16 CPUs
    args = {"opt_level": "O3", "keep_batchnorm_fp32": True, "master_weights": True, "loss_scale": "dynamic"}
    o3 = vissl(MODEL={"AMP_PARAMS": {"USE_AMP": True, "AMP_ARGS": args}})
    assert o3["precision"] == args and o3["optim_wrapper"]["type"] == "OptimWrapper"
    assert vissl(MODEL={"AMP_PARAMS": {"USE_AMP": True, "AMP_ARGS": {"opt_level": "O2"}}})["precision"] == \
        {"opt_level": "O2"}  # Apex's O2 defaults are the precision setting's own
    torch_amp = vissl(MODEL={"AMP_PARAMS": {"USE_AMP": True, "AMP_TYPE": "pytorch", "AMP_ARGS": {"opt_level": "O3"}}})
    assert torch_amp["optim_wrapper"]["type"] == "AmpOptimWrapper" and "precision" not in torch_amp
    off = vissl(MODEL={"AMP_PARAMS": {"USE_AMP": False, "AMP_ARGS": {"opt_level": "O3"}}})
    assert off["optim_wrapper"]["type"] == "OptimWrapper" and "precision" not in off


def test_stateful_sampler_snippet():
    test = {"DATA_SOURCES": ["synthetic"], "LABEL_SOURCES": ["synthetic"], "BATCHSIZE_PER_REPLICA": 2,
            "USE_STATEFUL_DISTRIBUTED_SAMPLER": True}
    cfg = vissl(DATA={"TRAIN": {"USE_STATEFUL_DISTRIBUTED_SAMPLER": True}, "TEST": test},
                METERS={"name": "accuracy_list_meter"})
    assert cfg["train_dataloader"]["sampler"] == dict(type="DefaultSampler", shuffle=True)
    assert cfg["val_dataloader"]["sampler"] == dict(type="DefaultSampler", shuffle=False)


def test_activation_checkpointing_snippet_and_manual_reduction_warns_once(caplog):
    sections = dict(MODEL={"ACTIVATION_CHECKPOINTING": {"USE_ACTIVATION_CHECKPOINTING": True,
                                                        "NUM_ACTIVATION_CHECKPOINTING_SPLITS": 8}},
                    DISTRIBUTED={"MANUAL_GRADIENT_REDUCTION": True})
    cfg = vissl(**sections)
    assert cfg["cfg"] == dict(activation_checkpointing=dict(splits=8, module="trunk"))
    vissl(**sections)
    warned = [r.getMessage() for r in caplog.records if "MANUAL_GRADIENT_REDUCTION" in r.getMessage()]
    assert warned == ["VISSL key config.DISTRIBUTED.MANUAL_GRADIENT_REDUCTION has no effect in memfit: memfit's DDP "
                      "reduces gradients in buckets during backward, which non-reentrant activation checkpointing "
                      "does not disturb"]
    caplog.clear()
    vissl(DISTRIBUTED={"MANUAL_GRADIENT_REDUCTION": False})  # VISSL's default: nothing to say
    assert not caplog.records


# -- the common keys ---------------------------------------------------------------------------------------
def test_optimizer_keys():
    cfg = vissl(OPTIMIZER={"name": "adamw", "weight_decay": 0.05, "betas": [0.9, 0.95], "num_epochs": 3,
                           "regularize_bn": False, "regularize_bias": False,
                           "non_regularized_parameters": ["class_token", "pos_embedding"],
                           "head_optimizer_params": {"use_different_wd": True, "weight_decay": 0.01}},
                MODEL={"GRAD_CLIP": {"USE_GRAD_CLIP": True, "MAX_NORM": 5}})
    ow = cfg["optim_wrapper"]
    assert ow["optimizer"] == dict(type="AdamW", lr=0.1, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-08,
                                   amsgrad=False)
    assert ow["paramwise_cfg"] == dict(norm_decay_mult=0.0, bias_decay_mult=0.0, custom_keys={
        "class_token": dict(decay_mult=0.0), "pos_embedding": dict(decay_mult=0.0),
        "heads": dict(decay_mult=pytest.approx(0.2))})  # the heads' 0.01 as a multiple of 0.05
    assert ow["clip_grad"] == dict(max_norm=5, norm_type=2)
    assert cfg["train_cfg"] == dict(by_epoch=True, max_epochs=3)
    # VISSL's defaults: BN not regularised, biases regularised; one group when asked
    assert vissl()["optim_wrapper"]["paramwise_cfg"] == dict(norm_decay_mult=0.0)
    assert "paramwise_cfg" not in vissl(OPTIMIZER={"construct_single_param_group_only": True})["optim_wrapper"]


def test_schedule_becomes_vissl_lr_with_its_interval():
    lr = {"name": "multistep", "values": [0.1, 0.01], "milestones": [1], "update_interval": "epoch"}
    assert vissl(OPTIMIZER={"param_schedulers": {"lr": lr}})["param_scheduler"] == dict(
        type="VisslLR", by_epoch=True, name="multistep", update_interval="epoch", num_epochs=2, values=[0.1, 0.01],
        milestones=[1])
    cosine = vissl(OPTIMIZER={"param_schedulers": {"lr": {"name": "cosine", "start_value": 0.4, "update_interval":
                                                           "step"}}})
    assert cosine["param_scheduler"] == dict(type="VisslLR", by_epoch=False, name="cosine", update_interval="step",
                                             start_value=0.4, end_value=0.0)  # end_value: VISSL's default
    assert cosine["optim_wrapper"]["optimizer"]["lr"] == 0.4  # the schedule's value at where=0


def test_auto_lr_scaling_uses_the_configs_global_batch():
    lr = {"name": "cosine", "start_value": 0.1, "end_value": 0.001,
          "auto_lr_scaling": {"auto_scale": True, "base_value": 0.1, "base_lr_batch_size": 256}}
    cfg = vissl(OPTIMIZER={"param_schedulers": {"lr": lr}}, DATA={"TRAIN": {"BATCHSIZE_PER_REPLICA": 32}},
                DISTRIBUTED={"NUM_NODES": 2, "NUM_PROC_PER_NODE": 8})
    sched = cfg["param_scheduler"]
    assert sched["start_value"] == pytest.approx(0.2) and sched["end_value"] == pytest.approx(0.002)
    assert "auto_lr_scaling" not in sched


def test_model_keys():
    cfg = vissl(MODEL={"TRUNK": {"NAME": "resnet", "RESNETS": {"DEPTH": 50, "WIDTH_MULTIPLIER": 2}},
                       "HEAD": {"PARAMS": [["eval_mlp", {"in_channels": 4096, "dims": [4096, 10]}]],
                                "BATCHNORM_EPS": 1e-3}},
                LOSS={"name": "cross_entropy_multiple_output_single_target",
                      "cross_entropy_multiple_output_single_target": {"temperature": 0.5}})
    model = cfg["model"]
    assert model["trunk"] == dict(name="resnet", depth=50, width_multiplier=2, norm="BatchNorm", groupnorm_groups=32,
                                  groups=1, width_per_group=64, zero_init_residual=False, layer4_stride=2)
    assert model["heads"] == [["eval_mlp", {"in_channels": 4096, "dims": [4096, 10]}]]
    assert model["loss"] == dict(name="cross_entropy_multiple_output_single_target", temperature=0.5)
    assert model["head_bn_eps"] == 1e-3
    vit = vissl(MODEL={"TRUNK": {"NAME": "vision_transformer", "VISION_TRANSFORMERS": {"name": "vit_b_16"}}})
    assert vit["model"]["trunk"] == dict(name="vision_transformer", image_size=224, patch_size=16, num_layers=12,
                                         num_heads=12, hidden_dim=768, mlp_dim=3072, dropout_rate=0,
                                         attention_dropout_rate=0, drop_path_rate=0, classifier="token",
                                         qkv_bias=False)
    regnet = vissl(MODEL={"TRUNK": {"NAME": "regnet", "REGNET": {"name": "regnet_y_1.6gf"}}})
    assert regnet["model"]["trunk"] == dict(name="regnet", regnet_name="regnet_y_1.6gf")
    assert vissl()["model"]["loss"] == dict(name="CrossEntropyLoss", ignore_index=-1)  # VISSL's default loss


def test_data_keys(tmp_path):
    transforms = [{"name": "RandomResizedCrop", "size": 224}, {"name": "RandomHorizontalFlip"}, {"name": "ToTensor"},
                  {"name": "Normalize", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}]
    test = {"DATA_SOURCES": ["disk_folder"], "LABEL_SOURCES": ["disk_folder"], "DATA_PATHS": [str(tmp_path)],
            "BATCHSIZE_PER_REPLICA": 16, "TRANSFORMS": [{"name": "Resize", "size": 256}, {"name": "CenterCrop",
                                                                                        "size": 224},
                                                      {"name": "ToTensor"}]}
    cfg = vissl(DATA={"NUM_DATALOADER_WORKERS": 2, "PIN_MEMORY": True,
                      "TRAIN": {"TRANSFORMS": transforms, "DROP_LAST": True, "DATA_LIMIT": -1}, "TEST": test},
                METERS={"name": "accuracy_list_meter", "accuracy_list_meter": {"topk_values": [1, 5]}},
                TEST_EVERY_NUM_EPOCH=2)
    train = cfg["train_dataloader"]
    assert train == dict(batch_size=4, num_workers=2, pin_memory=True, drop_last=True,
                         sampler=dict(type="DefaultSampler", shuffle=True),
                         dataset=dict(type="ShapesDataset", num_samples=50000, image_size=32, num_classes=4,
                                      split="train", transform=[
                                          dict(type="RandomResizedCrop", size=224), dict(type="RandomHorizontalFlip"),
                                          dict(type="ToDtype", dtype="float32", scale=True),
                                          dict(type="Normalize", mean=[0.485, 0.456, 0.406],
                                               std=[0.229, 0.224, 0.225])]))
    assert cfg["val_dataloader"]["dataset"] == dict(type="ImageFolder", root=str(tmp_path), pipeline=[
        dict(type="Resize", size=256), dict(type="CenterCrop", size=224),
        dict(type="ToDtype", dtype="float32", scale=True)])
    assert cfg["val_evaluator"] == dict(type="Accuracy", topk=(1, 5)) and cfg["val_cfg"] == {}
    assert cfg["train_cfg"]["val_interval"] == 2
    assert "val_dataloader" not in vissl(TEST_MODEL=False, DATA={"TEST": test}, METERS={"name": "accuracy_list_meter"})


def test_runtime_keys(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = vissl(SEED_VALUE=7, LOG_FREQUENCY=5, VERBOSE=True,
                CHECKPOINT={"DIR": "/tmp/run", "CHECKPOINT_FREQUENCY": 3, "CHECKPOINT_ITER_FREQUENCY": 100,
                            "AUTO_RESUME": False},
                DISTRIBUTED={"NUM_NODES": 1, "NUM_PROC_PER_NODE": 2, "BACKEND": "gloo", "BROADCAST_BUFFERS": False},
                HOOKS={"TENSORBOARD_SETUP": {"USE_TENSORBOARD": True}})
    assert cfg["randomness"] == dict(seed=7) and cfg["log_level"] == "DEBUG"
    assert cfg["default_hooks"] == dict(logger=dict(interval=5), checkpoint=dict(interval=3))
    assert cfg["custom_hooks"] == [dict(type="CheckpointHook", interval=100, by_epoch=False, save_last=False)]
    assert cfg["work_dir"] == "/tmp/run" and cfg["resume"] is False
    assert cfg["env_cfg"] == dict(dist_cfg=dict(backend="gloo"))
    assert cfg["strategy"] == dict(type="DDPStrategy", broadcast_buffers=False)
    assert cfg["visualizer"]["vis_backends"][-1] == dict(type="TensorboardVisBackend")
    base = vissl()
    assert base["resume"] is True and "work_dir" not in base  # AUTO_RESUME's default; memfit's work dir


def test_launch_mismatch_warns_once(monkeypatch, caplog):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    vissl(DISTRIBUTED={"NUM_PROC_PER_NODE": 8})
    vissl(DISTRIBUTED={"NUM_PROC_PER_NODE": 8})
    lines = [r.getMessage() for r in caplog.records if "NUM_PROC_PER_NODE" in r.getMessage()]
    assert len(lines) == 1 and "`memfit train CFG --gpus 8`" in lines[0]


# -- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sections, message", [
    (dict(OPTIMIZER={"use_lars": True}), "unknown VISSL key 'config.OPTIMIZER.use_lars': did you mean 'use_larc'?"),
    (dict(DATAA={}), "unknown VISSL key 'config.DATAA': did you mean 'DATA'?"),
    (dict(MODEL={"FSDP_CONFIG": {"AUTO_SETUP_FSDP": True}}),
     "VISSL key config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True is not supported by memfit: strategy='fsdp' "
     "(FSDPStrategy)"),
    (dict(TEST_ONLY=True), "VISSL key config.TEST_ONLY=True is not supported by memfit: evaluate a checkpoint with "
                           "`memfit eval CFG --checkpoint FILE`"),
    (dict(LOSS={"name": "simclr_info_nce_loss"}), "VISSL key config.LOSS.name='simclr_info_nce_loss' is not "
                                                  "supported by memfit"),
    (dict(MODEL={"TRUNK": {"NAME": "efficientnet"}}), "VISSL key config.MODEL.TRUNK.NAME='efficientnet'"),
    (dict(OPTIMIZER={"name": "adam", "use_larc": True}), "config.OPTIMIZER.use_larc=True is not supported by memfit: "
                                                         "VISSL applies LARC to sgd only"),
    (dict(DATA={"TRAIN": {"TRANSFORMS": [{"name": "ImgPilToMultiCrop"}]}}),
     "VISSL key config.DATA.TRAIN.TRANSFORMS[0].name='ImgPilToMultiCrop' is not supported by memfit"),
    (dict(DATA={"TRAIN": {"COLLATE_FUNCTION": "multicrop_collator"}}), "config.DATA.TRAIN.COLLATE_FUNCTION"),
    (dict(OPTIMIZER={"param_schedulers": {"lr": {"name": "inverse_sqrt"}}}), "lr.name='inverse_sqrt'"),
    (dict(MODEL={"AMP_PARAMS": {"USE_AMP": True, "AMP_ARGS": {"opt_level": "O2", "cast_model_type": "half"}}}),
     "config.MODEL.AMP_PARAMS.AMP_ARGS.cast_model_type"),
])
def test_unsupported_keys_are_one_line_errors(sections, message):
    with pytest.raises(ConfigError) as info:
        vissl(**sections)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_refused_keys_at_vissl_defaults_are_accepted():
    # A config may spell out VISSL's defaults: refused and warned keys only act on other values.
    vissl(TEST_ONLY=False, MODEL={"FSDP_CONFIG": {"AUTO_SETUP_FSDP": False, "flatten_parameters": True}},
          SVM={"normalize": True}, LOSS={"swav_loss": {"temperature": 0.1}}, SLURM={"USE_SLURM": False},
          HOOKS=None)  # an empty section, as YAML reads `HOOKS:`


def test_yaml_file_with_config_root_is_read_as_vissl(tmp_path):
    path = tmp_path / "vissl.yaml"
    path.write_text(yaml.safe_dump({"config": BASE}))
    cfg = Config.fromfile(path)
    assert cfg.model.type == "VisslModel" and cfg.param_scheduler.type == "VisslLR"
    path.write_text(yaml.safe_dump({"config": BASE, "defaults": ["_self_"]}))
    with pytest.raises(ConfigError, match=r"this file also has 'defaults'"):
        Config.fromfile(path)
    path.write_text(yaml.safe_dump({"config": {**BASE, "OPTIMIZER": {"use_lars": True}}}))
    with pytest.raises(ConfigError, match=re.escape(f"config {path}: unknown VISSL key 'config.OPTIMIZER.use_lars'")):
        Config.fromfile(path)


def test_seed_yaml_floats_without_a_dot_are_numbers():
    # The seed writes `eps: 1e-08`, which YAML 1.1 (PyYAML) reads as a string and VISSL's OmegaConf as a float.
    text = (SEED_CONFIGS / "larc.yaml").read_text()
    assert "eps: 1e-08" in text
    assert Config.fromfile(SEED_CONFIGS / "larc.yaml").optim_wrapper.optimizer.eps == 1e-08


@pytest.mark.skipif(not (ROOT / "docs" / "vissl.md").exists(), reason="docs/vissl.md not written yet")
def test_docs_table_lists_every_key_with_its_status():
    doc = (ROOT / "docs" / "vissl.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| (supported|warned|refused|inert) \|", doc, flags=re.M))
    assert rows == {k: v.status for k, v in KEYS.items()}
    assert {k for k, v in KEYS.items() if v.status in (WARNED, REFUSED)} <= set(rows)


def test_warned_and_refused_keys_have_a_vissl_default():
    # Without a default every value would warn or fail, even the one VISSL ships with.
    assert [k for k, v in KEYS.items() if v.status in (WARNED, REFUSED) and v.default is MISSING] == []


def test_warnings_use_the_memfit_logger(caplog):
    vissl(METERS={"enable_training_meter": True})
    assert [r.levelno for r in caplog.records if "enable_training_meter" in r.getMessage()] == [logging.WARNING]
