"""dump_config: Python and YAML files that Config.fromfile reads back equal; placeholders, no crash."""

from __future__ import annotations

import enum
import functools
import os
import textwrap

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

from memfit.config import Config, config_to_python, dump_config, validate_config
from memfit.errors import ConfigError


class Mode(enum.Enum):
    FAST = "fast"


PLAIN = dict(
    model=dict(
        type="ImageClassifier", backbone=dict(depth=[2, 2, 18, 2], drop_path_rate=0.0), num_classes=10
    ),
    train_cfg=dict(by_epoch=True, max_epochs=12, val_interval=1),
    param_scheduler=[
        dict(type="LinearLR", start_factor=1e-3, end=5),
        dict(type="CosineAnnealingLR", T_max=12),
    ],
    optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer=dict(type="AdamW", lr=1e-4)),
    work_dir="./work_dirs/swin l",
    load_from=None,
    cfg=dict(activation_checkpointing=["backbone.layers.0"], efficient_conv_bn_eval=["backbone"]),
    text='it\'s "quoted"\nnewline',
    pair=(1, (2,), []),
    numbers={1: "one", "with space": 2, "class": 3},
    long_list=list(range(60)),
)


@pytest.mark.parametrize("suffix", [".py", ".yaml"])
def test_plain_values_round_trip(tmp_path, suffix):
    path = dump_config(Config(PLAIN), tmp_path / f"cfg{suffix}")
    back = Config.fromfile(path).to_dict()
    if suffix == ".yaml":  # YAML has no tuples
        assert back.pop("pair") == [1, [2], []]
        assert back == {k: v for k, v in PLAIN.items() if k != "pair"}
    else:
        assert back == PLAIN
        assert type(back["pair"]) is tuple and type(back["pair"][1]) is tuple


def test_long_values_break_into_lines_and_short_ones_stay_inline(tmp_path):
    text = config_to_python(PLAIN)
    assert "train_cfg = dict(by_epoch=True, max_epochs=12, val_interval=1)\n" in text
    assert "numbers = {1: 'one', 'with space': 2, 'class': 3}\n" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_classes_functions_and_torch_values_become_imports(tmp_path):
    cfg = Config(
        optim_wrapper=dict(optimizer=dict(type=torch.optim.SGD, lr=0.1), dtype=torch.bfloat16),
        model=dict(type=nn.Linear, act=nn.functional.relu, norm=nn.LayerNorm, device=torch.device("cpu")),
        strategy=dict(policy=functools.partial(torch.nn.init.normal_, std=0.02)),
        val_evaluator=dict(type=dict, mode=Mode.FAST, inf=float("inf")),
    )
    path = dump_config(cfg, tmp_path / "cfg.py")
    text = path.read_text()
    assert "from torch.optim import SGD\n" in text and "type=SGD" in text
    assert "from torch import bfloat16" in text
    assert "not serialisable" not in text
    back = Config.fromfile(path)
    policy = back.strategy.pop("policy")  # partial objects compare by identity: check their parts
    assert policy.func is torch.nn.init.normal_ and policy.keywords == {"std": 0.02}
    del cfg.strategy.policy
    assert back == cfg
    assert back.optim_wrapper.optimizer.type is torch.optim.SGD
    assert back.model.act is nn.functional.relu and back.val_evaluator.mode is Mode.FAST
    assert list(back) == list(cfg)  # imports are not keys


def test_import_names_never_clash_with_config_keys(tmp_path):
    cfg = Config(SGD=1, dict=2, model=dict(type=torch.optim.SGD, kind=dict))
    path = dump_config(cfg, tmp_path / "cfg.py")
    assert "from torch.optim import SGD as SGD_2" in path.read_text()
    back = Config.fromfile(path)
    assert back == cfg and back.model.type is torch.optim.SGD and back.model.kind is dict


def test_live_objects_become_placeholders_with_a_comment(tmp_path):
    loader = DataLoader([1, 2, 3], batch_size=2)
    local_fn = lambda x: x  # noqa: E731 - a lambda has no import path
    cfg = Config(
        model=nn.Linear(2, 2),
        train_dataloader=loader,
        optim_wrapper=dict(optimizer=dict(type="SGD", params=[torch.zeros(2)]), hook=local_fn),
        train_cfg=dict(by_epoch=True, max_epochs=1),
    )
    text = dump_config(cfg, tmp_path / "cfg.py").read_text()
    assert "model = '<not serialisable: Linear>'  # a live torch.nn.modules.linear.Linear object" in text
    assert "train_dataloader = '<not serialisable: DataLoader>'  # a live " in text
    assert "'<not serialisable: Tensor>',  # a live torch.Tensor object" in text
    assert "hook='<not serialisable: <lambda>>',  #" in text
    back = Config.fromfile(tmp_path / "cfg.py")
    assert back.train_dataloader == "<not serialisable: DataLoader>"
    assert back.optim_wrapper.optimizer.params == ["<not serialisable: Tensor>"]
    assert back.train_cfg == cfg.train_cfg
    validate_config(back)

    ytext = dump_config(cfg, tmp_path / "cfg.yaml").read_text()
    assert "<not serialisable: DataLoader>'  # not serialisable" in ytext
    assert Config.fromfile(tmp_path / "cfg.yaml").model == "<not serialisable: Linear>"


def test_yaml_writes_code_as_its_import_path(tmp_path):
    cfg = Config(
        optim_wrapper=dict(optimizer=dict(type=torch.optim.AdamW)),
        dtype=torch.float16,
        n=torch.tensor(1).item(),
    )
    data = yaml.safe_load(dump_config(cfg, tmp_path / "cfg.yml").read_text())
    assert data == {
        "optim_wrapper": {"optimizer": {"type": "torch.optim.AdamW"}},
        "dtype": "torch.float16",
        "n": 1,
    }


def test_recursive_and_odd_keys_do_not_crash(tmp_path):
    loop: dict = {"a": 1}
    loop["self"] = loop
    cfg = {"model": loop, "odd-key": 3}
    back = Config.fromfile(dump_config(cfg, tmp_path / "cfg.py"))
    assert back["odd-key"] == 3
    assert back.model.self == "<not serialisable: recursive dict>"
    assert Config.fromfile(dump_config(cfg, tmp_path / "cfg.yaml")).model.self.startswith("<not serialisable")


def test_write_is_atomic_and_suffix_is_checked(tmp_path):
    target = tmp_path / "deep" / "cfg.py"
    dump_config({"work_dir": "a"}, target)
    dump_config({"work_dir": "b"}, target)
    assert os.listdir(target.parent) == ["cfg.py"]  # no temporary file left behind
    assert Config.fromfile(target).work_dir == "b"
    with pytest.raises(ConfigError, match=r"cfg\.json.*use a \.py, \.yaml or \.yml"):
        dump_config({}, tmp_path / "cfg.json")


def test_loaded_file_dumps_to_an_equal_file(tmp_path):
    (tmp_path / "base.py").write_text(
        textwrap.dedent(
            """
            from torch.optim import AdamW
            optim_wrapper = dict(type='AmpOptimWrapper', optimizer=dict(type=AdamW, betas=(0.9, 0.999)))
            train_cfg = dict(by_epoch=False, max_iters=100, val_interval=50)
            """
        )
    )
    (tmp_path / "child.yaml").write_text("_base_: base.py\noptim_wrapper: {accumulative_counts: 4}\n")
    cfg = Config.fromfile(tmp_path / "child.yaml")
    again = Config.fromfile(dump_config(cfg, tmp_path / "resolved.py"))
    assert again == cfg and again.optim_wrapper.optimizer.type is torch.optim.AdamW
