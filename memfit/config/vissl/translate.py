"""Translate a VISSL ``config:`` mapping into memfit's config (the Runner's keyword arguments).

:func:`translate` first walks the keys (:func:`memfit.config.vissl.keys.check_keys`: unknown and
refused keys fail, keys with no effect warn once), then builds each memfit section from the VISSL
keys it needs, taking VISSL's default (``defaults.yaml``) for a key the file leaves out. The
result is plain dicts with registry names, so ``memfit convert`` can print it as a Python config.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from memfit.config.vissl.keys import KEYS, Vissl, as_int, check_keys, refuse
from memfit.config.vissl.training import training_sections
from memfit.errors import ConfigError, warn_ignored

# OmegaConf (VISSL's loader) reads `1e-08` as a float; PyYAML's YAML 1.1 rules keep it a string.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")

# ClassyVision's named vision transformers: (patch, layers, heads, hidden, mlp).
VIT_PRESETS = {"vit_b_32": (32, 12, 12, 768, 3072), "vit_b_16": (16, 12, 12, 768, 3072),
               "vit_l_32": (32, 24, 16, 1024, 4096), "vit_l_16": (16, 24, 16, 1024, 4096),
               "vit_h_14": (14, 32, 16, 1280, 5120)}
SYNTHETIC_SIZE = 50_000  # VISSL's synthetic dataset length when DATA_LIMIT is not set
MAX_SHAPES = 10  # classes of memfit's ShapesDataset


def translate(vissl: Mapping[str, Any]) -> dict[str, Any]:
    """The memfit config equivalent to a VISSL ``config`` mapping (see docs/vissl.md)."""
    get = Vissl(check_keys(_numbers(copy.deepcopy(dict(vissl)))))
    out: dict[str, Any] = {}
    model = _model(get)
    out["model"] = model
    out.update(_data(get, model))
    out["train_cfg"] = dict(by_epoch=True, max_epochs=as_int(get("OPTIMIZER.num_epochs"), "OPTIMIZER.num_epochs"))
    if "val_dataloader" in out:
        out["train_cfg"]["val_interval"] = as_int(get("TEST_EVERY_NUM_EPOCH"), "TEST_EVERY_NUM_EPOCH")
    out.update(training_sections(get, out["train_cfg"]["max_epochs"]))
    return out


def _numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    return value


# -- model -------------------------------------------------------------------------------------------------
def _model(get: Vissl) -> dict[str, Any]:
    name = get("MODEL.TRUNK.NAME")
    if name == "resnet":
        r = "MODEL.TRUNK.RESNETS."
        trunk = dict(name="resnet", depth=get(r + "DEPTH"), width_multiplier=get(r + "WIDTH_MULTIPLIER"),
                     norm=get(r + "NORM"), groupnorm_groups=get(r + "GROUPNORM_GROUPS"), groups=get(r + "GROUPS"),
                     width_per_group=get(r + "WIDTH_PER_GROUP"), zero_init_residual=get(r + "ZERO_INIT_RESIDUAL"),
                     layer4_stride=get(r + "LAYER4_STRIDE"))
    elif name == "vision_transformer":
        v = "MODEL.TRUNK.VISION_TRANSFORMERS."
        dims = dict(patch_size=get(v + "PATCH_SIZE"), num_layers=get(v + "NUM_LAYERS"), num_heads=get(v + "NUM_HEADS"),
                    hidden_dim=get(v + "HIDDEN_DIM"), mlp_dim=get(v + "MLP_DIM"))
        preset = get(v + "name")
        if preset:
            if preset not in VIT_PRESETS:
                raise refuse(v + "name", preset, f"use one of {', '.join(VIT_PRESETS)} or give the sizes")
            dims = dict(zip(dims, VIT_PRESETS[preset], strict=True))
        trunk = dict(name="vision_transformer", image_size=get(v + "IMAGE_SIZE"), **dims,
                     dropout_rate=get(v + "DROPOUT_RATE"), attention_dropout_rate=get(v + "ATTENTION_DROPOUT_RATE"),
                     drop_path_rate=get(v + "DROP_PATH_RATE"), classifier=get(v + "CLASSIFIER"),
                     qkv_bias=get(v + "QKV_BIAS"))
    elif name == "regnet":
        params = get("MODEL.TRUNK.REGNET")
        if not isinstance(params, Mapping) or not params:
            raise refuse("MODEL.TRUNK.REGNET", params, "give name (e.g. regnet_y_400mf) or depth, w_0, w_a, w_m, "
                                                        "group_width")
        trunk = dict(name="regnet", **{"regnet_name" if k == "name" else k: v for k, v in params.items()})
    else:
        raise refuse("MODEL.TRUNK.NAME", name, "memfit translates resnet, regnet and vision_transformer trunks; "
                                                "write another trunk as a memfit BaseModel")
    model: dict[str, Any] = dict(type="VisslModel", trunk=trunk, heads=_heads(get("MODEL.HEAD.PARAMS")),
                                 loss=_loss(get))
    for key, arg in (("BATCHNORM_EPS", "head_bn_eps"), ("BATCHNORM_MOMENTUM", "head_bn_momentum"),
                     ("PARAMS_MULTIPLIER", "head_params_multiplier")):
        if get(f"MODEL.HEAD.{key}") != KEYS[f"MODEL.HEAD.{key}"].default:
            model[arg] = get(f"MODEL.HEAD.{key}")
    return model


def _heads(params: Any) -> list:
    key = "MODEL.HEAD.PARAMS"
    if not isinstance(params, list):
        raise ConfigError(f"VISSL key config.{key} must be a list of [name, {{kwargs}}] pairs, got {params!r}")
    heads = []
    for i, item in enumerate(params):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise refuse(f"{key}[{i}]", item, "one chain of [name, {kwargs}] pairs; several heads (lists of "
                                               "chains) need a memfit BaseModel")
        if item[0] not in ("mlp", "eval_mlp"):
            raise refuse(f"{key}[{i}]", item[0], "memfit has the 'mlp' and 'eval_mlp' heads")
        heads.append([item[0], dict(item[1] or {})])
    return heads


def _loss(get: Vissl) -> dict[str, Any]:
    name = get("LOSS.name")
    if name not in ("cross_entropy_multiple_output_single_target", "CrossEntropyLoss"):
        raise refuse("LOSS.name", name, "memfit translates cross_entropy_multiple_output_single_target and "
                                         "CrossEntropyLoss; write a self-supervised loss in a memfit BaseModel")
    params = get(f"LOSS.{name}")
    if not isinstance(params, Mapping):
        raise ConfigError(f"VISSL key config.LOSS.{name} must be a dict of the loss's options, got {params!r}")
    return dict(name=name, **params)


# -- data --------------------------------------------------------------------------------------------------
def _data(get: Vissl, model: dict[str, Any]) -> dict[str, Any]:
    heads = model["heads"]
    outputs = heads[-1][1].get("dims", [None])[-1] if heads else None
    out = {"train_dataloader": _loader(get, "TRAIN", outputs)}
    if get("TEST_MODEL") and get("DATA.TEST.DATA_SOURCES"):
        evaluator = _evaluator(get)
        if evaluator is None:
            warn_ignored("VISSL DATA.TEST without METERS", "memfit validates with a metric: add "
                                                           "METERS: {name: accuracy_list_meter}")
        else:
            out.update(val_dataloader=_loader(get, "TEST", outputs), val_evaluator=evaluator, val_cfg=dict())
    return out


def _loader(get: Vissl, split: str, outputs: int | None) -> dict[str, Any]:
    d = f"DATA.{split}."
    sources, labels = get(d + "DATA_SOURCES"), get(d + "LABEL_SOURCES")
    if not sources:
        raise ConfigError(f"VISSL key config.{d}DATA_SOURCES is empty: use [synthetic], or [disk_folder] with "
                          "DATA_PATHS")
    if len(sources) != 1 or sources[0] not in ("synthetic", "disk_folder"):
        raise refuse(d + "DATA_SOURCES", sources, "one source per split: synthetic (memfit's ShapesDataset) or "
                                                   "disk_folder (ImageFolder)")
    label_type = get(d + "LABEL_TYPE")
    if list(labels) != list(sources) or label_type != "standard":
        raise refuse(d + "LABEL_SOURCES", labels, f"memfit trains on the class labels that come with the images: "
                                                   f"set LABEL_SOURCES: {sources} and LABEL_TYPE: standard "
                                                   "(sample_index and zero labels are for SSL losses)")
    transform = _transforms(get(d + "TRANSFORMS"), d + "TRANSFORMS")
    limit = as_int(get(d + "DATA_LIMIT"), d + "DATA_LIMIT", -1)
    if sources[0] == "synthetic":
        classes = get(d + "RANDOM_SYNTHETIC_LABELS") or outputs or MAX_SHAPES
        dataset: dict[str, Any] = dict(type="ShapesDataset", num_samples=limit if limit > 0 else SYNTHETIC_SIZE,
                                       image_size=get(d + "DEFAULT_GRAY_IMG_SIZE"),
                                       num_classes=min(int(classes), MAX_SHAPES),
                                       split="train" if split == "TRAIN" else "val")
        if transform is not None:
            dataset["transform"] = transform
    else:
        paths = get(d + "DATA_PATHS")
        if not isinstance(paths, list) or len(paths) != 1:
            raise ConfigError(f"VISSL key config.{d}DATA_PATHS={paths!r}: give one folder of class folders "
                              "(memfit has no dataset catalog)")
        if limit > 0:
            raise refuse(d + "DATA_LIMIT", limit, "limits apply to synthetic data only: use a smaller folder")
        dataset = dict(type="ImageFolder", root=paths[0])
        if transform is not None:
            dataset["pipeline"] = transform
    workers = as_int(get("DATA.NUM_DATALOADER_WORKERS"), "DATA.NUM_DATALOADER_WORKERS", 0)
    loader: dict[str, Any] = dict(batch_size=as_int(get(d + "BATCHSIZE_PER_REPLICA"), d + "BATCHSIZE_PER_REPLICA"),
                                  num_workers=workers)
    if "DATA.PIN_MEMORY" in get:  # VISSL pins by default; only CUDA can pin, so memfit pins when asked
        loader["pin_memory"] = bool(get("DATA.PIN_MEMORY"))
    if get(d + "DROP_LAST"):
        loader["drop_last"] = True
    loader["sampler"] = dict(type="DefaultSampler", shuffle=split == "TRAIN")
    loader["dataset"] = dataset
    return loader


def _transforms(items: Any, key: str) -> list[dict[str, Any]] | None:
    if not items:
        return None
    if not isinstance(items, list):
        raise ConfigError(f"VISSL key config.{key} must be a list of {{name: ..., ...}}, got {items!r}")
    import torchvision.transforms.v2 as T

    out = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or "name" not in item:
            raise ConfigError(f"VISSL key config.{key}[{i}]={item!r}: each transform is {{name: ..., <arguments>}}")
        args = {k: v for k, v in item.items() if k != "name"}
        if args.pop("transform_type", None) not in (None, "torchvision"):
            raise refuse(f"{key}[{i}].transform_type", item["transform_type"], "torchvision transforms only")
        name = item["name"]
        if name == "ToTensor":  # our images are uint8 tensors: ToTensor's job is the float conversion
            out.append(dict(type="ToDtype", dtype="float32", scale=True))
        elif isinstance(name, str) and name[:1].isupper() and hasattr(T, name):
            out.append(dict(type=name, **args))
        else:
            raise refuse(f"{key}[{i}].name", name, "a VISSL transform memfit does not have: use "
                                                    "torchvision.transforms.v2 names (RandomResizedCrop, ...)")
    if not any(t["type"] == "ToDtype" for t in out):
        raise ConfigError(f"VISSL key config.{key} has no ToTensor: add it (the model takes float images)")
    return out


def _evaluator(get: Vissl) -> dict[str, Any] | None:
    names = [n for n in [get("METERS.name"), *get("METERS.names")] if n]
    names = list(dict.fromkeys(names))
    if not names:
        return None
    if names != ["accuracy_list_meter"]:
        raise refuse("METERS.name", names, "memfit's evaluator is top-k accuracy (accuracy_list_meter)")
    num = get("METERS.accuracy_list_meter.num_meters")
    if num != 1:
        raise refuse("METERS.accuracy_list_meter.num_meters", num, "one meter on the head's output")
    return dict(type="Accuracy", topk=tuple(get("METERS.accuracy_list_meter.topk_values")))
