"""Bad configs that used to train a while and fail deep inside torch (or train silently) are refused
before the first training step, in one line naming the full key and the fix; the example configs stay
valid when the run is shortened from the command line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.checks import check_classes
from memfit.config import Config, parse_cfg_options
from memfit.data import build_dataloader
from memfit.errors import ConfigError, ConfigTypeError
from memfit.model import BaseModel
from memfit.model.classifier import ImageClassifier
from memfit.optim.scheduler import build_param_schedulers
from memfit.runner import Runner

CONFIGS = Path(__file__).parents[2] / "configs"
SHAPES = dict(type="ShapesDataset", num_samples=8, image_size=16, num_classes=2)
CALLS = {"loss": 0}


class Counting(BaseModel):
    """A linear classifier over 16x16 shapes that counts its training forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 2)

    def forward(self, img, label=None, mode="tensor", **_):
        out = self.fc(img.flatten(1))
        if mode == "loss":
            CALLS["loss"] += 1
            return {"loss": F.cross_entropy(out, label)}
        return out


def config(**overrides: Any) -> dict:
    cfg = dict(model=dict(type=Counting), work_dir="w", train_dataloader=dict(batch_size=4, dataset=SHAPES),
               train_cfg=dict(by_epoch=True, max_epochs=2), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
               default_hooks=dict(checkpoint=None, logger=dict(interval=100, tensorboard=False)))
    cfg.update(overrides)
    return cfg


def refused(cfg: dict, kind: type = ConfigError) -> str:
    """Build and train ``cfg``: it must be refused before any training forward; returns the message."""
    CALLS["loss"] = 0
    with pytest.raises(kind) as exc:
        Runner.from_cfg(cfg).train()
    assert CALLS["loss"] == 0, "a training step ran before the config was refused"
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_a_scheduler_argument_that_divides_by_zero_at_its_first_step():
    msg = refused(config(param_scheduler=[dict(type="LinearLR", by_epoch=False, end=2),
                                          dict(type="StepLR", step_size=0)]))
    assert msg.startswith("param_scheduler[1]: step_size=0: use a positive number of epochs")


def test_a_classifier_with_fewer_outputs_than_its_dataset_has_classes():
    model = dict(type="ImageClassifier", backbone=dict(type="resnet18", num_classes=2))
    msg = refused(config(model=model, train_dataloader=dict(batch_size=4, dataset=dict(SHAPES, num_classes=4))))
    assert msg.startswith("model.num_classes=2 but train_dataloader.dataset.num_classes=4: labels 2..3")
    assert msg.endswith("set model.num_classes=4")


def test_classes_come_from_num_classes_or_metainfo_and_more_outputs_are_allowed():
    class Timmish(nn.Module):  # timm's classifiers say num_classes; 0 (no head) says nothing
        def __init__(self, n: int) -> None:
            super().__init__()
            self.num_classes = n

    assert ImageClassifier(Timmish(3)).num_classes == 3 and ImageClassifier(Timmish(0)).num_classes is None
    assert ImageClassifier(nn.Sequential(nn.Flatten(), nn.Linear(4, 2))).num_classes is None  # unknown: unchecked
    loader = type("Loader", (), {"dataset": type("Coco", (), {"metainfo": {"classes": ("a", "b", "c")}})()})()
    check_classes(ImageClassifier(Timmish(5)), val_dataloader=loader)
    with pytest.raises(ConfigError, match=r"^model\.num_classes=2 but val_dataloader\.dataset\.metainfo\['classes'\] "
                                          r"names 3 classes"):
        check_classes(ImageClassifier(Timmish(2)), val_dataloader=loader)


def test_a_detector_with_fewer_classes_than_its_dataset_names_its_own_key():
    """MMDetection's num_classes (no background): torchvision's detectors on the model, DINO on its head; a label the
    detector has no class for failed at the first step (an out-of-bounds index in the loss)."""
    from memfit.registry import MODELS

    loader = type("Loader", (), {"dataset": type("Coco", (), {"metainfo": {"classes": ("a", "b", "c", "d")}})()})()
    fcos = MODELS.build(dict(type="FCOS", backbone=dict(model_name="resnet18"), num_classes=3, out_channels=32))
    with pytest.raises(ConfigError, match=r"^model\.num_classes=3 but train_dataloader\.dataset\.metainfo\['classes'\] "
                                          r"names 4 classes: .* set model\.num_classes=4$"):
        check_classes(fcos, train_dataloader=loader)
    dino_cfg = Config.fromfile(Path(__file__).parents[1] / "fixtures" / "detection" / "dino_tiny.py").to_dict()["model"]
    dino = MODELS.build({**dino_cfg, "bbox_head": {**dino_cfg["bbox_head"], "num_classes": 2}}, key="model")
    with pytest.raises(ConfigError, match=r"^model\.bbox_head\.num_classes=2 but .* set "
                                          r"model\.bbox_head\.num_classes=4$"):
        check_classes(dino, train_dataloader=loader)
    check_classes(MODELS.build({**dino_cfg, "bbox_head": {**dino_cfg["bbox_head"], "num_classes": 80}}, key="model"),
                  train_dataloader=loader)  # more classes than the data names: allowed


@pytest.mark.parametrize("scale", [-1.0, 0, dict(init_scale=-8.0)])
def test_a_loss_scale_out_of_range_with_bf16(scale):
    wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16", loss_scale=scale, optimizer=dict(type="SGD", lr=0.1))
    msg = refused(config(optim_wrapper=wrapper))
    assert msg.startswith("optim_wrapper.loss_scale") and "a fixed scale must be positive" in msg


def test_a_loss_scale_that_bf16_does_not_use_is_said_once(caplog):
    from memfit.precision import amp_precision

    precision = amp_precision(torch.bfloat16, "cpu", loss_scale=512.0)
    assert precision.scaler is None
    assert "optim_wrapper.loss_scale=512.0 has no effect" in caplog.text and "dtype='float16'" in caplog.text
    with pytest.raises(ConfigError, match=r"^optim_wrapper\.loss_scale: unknown key 'init_scal'"):
        amp_precision(torch.float16, "cpu", loss_scale=dict(init_scal=8.0))


@pytest.mark.parametrize("mode, given", [("val", dict(val_cfg=dict())),
                                         ("val", dict(val_dataloader=dict(batch_size=4, dataset=SHAPES))),
                                         ("test", dict(test_evaluator=dict(type="Accuracy"), test_cfg=dict()))])
def test_an_incomplete_val_or_test_triple_is_refused_at_construction(mode, given):
    with pytest.raises(ConfigError) as exc:
        Runner.from_cfg(config(**given))
    msg = str(exc.value)
    assert msg.startswith(" and ".join(given) + " given without")
    assert f"{mode}_dataloader, {mode}_evaluator and {mode}_cfg go together" in msg


def test_a_wrongly_typed_optimizer_value_names_the_key():
    msg = refused(config(optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum="high"))), ConfigTypeError)
    assert msg.startswith("optim_wrapper.optimizer.momentum='high': ")
    assert msg.endswith("(SGD): use a number (the default is 0)")


def test_an_optimizer_range_error_names_the_key():
    msg = refused(config(optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-3, betas=(0.9, 1.5)))))
    assert msg == "optim_wrapper.optimizer.betas=(0.9, 1.5): invalid beta parameter at index 1: 1.5 (AdamW)"


@pytest.mark.parametrize("betas", [[0.9], 0.9])
def test_too_few_betas_name_how_many(betas):
    msg = refused(config(optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-3, betas=betas))))
    assert msg.startswith(f"optim_wrapper.optimizer.betas={betas!r}: ")
    assert msg.endswith("(AdamW): give 2 values, as the default (0.9, 0.999)")


def test_each_optimizer_of_several_is_named_by_its_own_key():
    from memfit.optim.builder import build_optim_wrapper

    model = nn.ModuleDict(dict(gen=nn.Linear(2, 2), dis=nn.Linear(2, 2)))
    cfg = dict(gen=dict(optimizer=dict(type="SGD", lr=0.1)), dis=dict(optimizer=dict(type="SGD", lr=0.1, momentum=-1)))
    with pytest.raises(ConfigError, match=r"^optim_wrapper\.dis\.optimizer\.momentum=-1: invalid momentum value"):
        build_optim_wrapper(model, cfg)


def test_yaml_tabs_say_to_indent_with_spaces(tmp_path):
    path = tmp_path / "tabbed.yaml"
    path.write_text("train_cfg:\n\tmax_epochs: 1\n")
    with pytest.raises(ConfigError, match=r"tabbed\.yaml line 2: .*'\\t'.*: YAML indents with spaces"):
        Config.fromfile(path)


def test_a_missing_shapes_coco_annotation_file_names_the_command_that_writes_it(tmp_path):
    from memfit.data.coco import CocoDataset

    root = tmp_path / "data" / "shapes_coco"
    with pytest.raises(ConfigError) as exc:
        CocoDataset(data_root=f"{root}/", ann_file="annotations/instances_train.json")
    assert f"`memfit data shapes-coco --out {root} --image-size 96 --num 2400`" in str(exc.value)
    with pytest.raises(ConfigError, match=r"does not exist: check data_root and ann_file$"):
        CocoDataset(data_root=f"{tmp_path}/coco/", ann_file="annotations/instances_train2017.json")


# ------------------------------------------------------------------ the example configs, shortened
def schedulers(cfg: Config, epoch_length: int) -> list:
    """Build ``cfg``'s schedulers for its run (no model: an SGD over one parameter)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.optim_wrapper["optimizer"]["lr"])
    epochs = cfg.train_cfg["max_epochs"]
    return build_param_schedulers(cfg.param_scheduler, optimizer, by_epoch_run=True, max_epochs=epochs,
                                  max_iters=epochs * epoch_length, epoch_length=epoch_length)


def test_the_demo_config_survives_the_issue_s_shortened_run():
    cfg = Config.fromfile(CONFIGS / "vit_shapes.py")
    cfg.merge_from_dict(parse_cfg_options(["train_dataloader.dataset.num_samples=640", "train_cfg.max_epochs=3",
                                           "train_dataloader.num_workers=0", "train_dataloader.persistent_workers=0"]))
    loader = build_dataloader(cfg.train_dataloader, seed=0, key="train_dataloader")
    assert len(loader) == 20
    warmup, cosine = schedulers(cfg, len(loader))
    assert (cosine.begin, cosine.end, cosine.by_epoch) == (0, 60, False)  # the whole run, stepped per iteration
    # The form it replaces names where its end came from and the fix.
    cfg.param_scheduler[1] = dict(type="CosineAnnealingLR", by_epoch=False, begin=100, eta_min=1e-5)
    with pytest.raises(ConfigError) as exc:
        schedulers(cfg, len(loader))
    assert str(exc.value).startswith("param_scheduler[1]: end=60 = 3 epochs x 20 iterations (end not set: the run's "
                                     "length) is not after begin=100")
    assert "convert_to_iter_based=True" in str(exc.value)


@pytest.mark.parametrize("name", sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.py")))
def test_every_example_config_builds_its_schedulers_for_a_one_epoch_run(name):
    cfg = Config.fromfile(CONFIGS / name)
    cfg.merge_from_dict({"train_cfg.max_epochs": 1})
    assert schedulers(cfg, epoch_length=3)


def test_the_demo_schedule_warms_up_then_anneals_over_the_default_run():
    cfg = Config.fromfile(CONFIGS / "vit_shapes.py")
    epoch_length = math.ceil(cfg.train_dataloader["dataset"]["num_samples"] / cfg.train_dataloader["batch_size"])
    built = schedulers(cfg, epoch_length)
    optimizer, lrs = built[0].optimizer, []
    for _ in range(cfg.train_cfg["max_epochs"] * epoch_length):
        lrs.append(optimizer.param_groups[0]["lr"])
        for scheduler in built:
            scheduler.step()
    peak = lrs.index(max(lrs))
    assert lrs[0] == pytest.approx(1e-5) and 90 <= peak <= 100 and max(lrs) > 0.95e-3
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] == pytest.approx(1e-5, rel=1e-2)
