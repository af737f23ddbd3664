"""Config: attribute access, Python/YAML files, _base_ chains with _delete_, dotted overrides, errors."""

from __future__ import annotations

import copy
import pickle
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.config import Config, merge_dicts
from memfit.errors import ConfigError


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


# -- the dict itself -------------------------------------------------------------------------------
def test_attribute_access_reaches_nested_dicts_and_dicts_in_lists():
    cfg = Config(
        train_cfg=dict(max_epochs=3), param_scheduler=[dict(type="LinearLR", end=5)], pair=(dict(a=1), 2)
    )
    assert cfg.train_cfg.max_epochs == 3
    assert cfg.param_scheduler[0].end == 5
    assert cfg.pair[0].a == 1 and isinstance(cfg.pair, tuple)
    cfg.model = dict(type="Net", depth=dict(n=2))
    assert isinstance(cfg.model.depth, Config) and cfg["model"]["depth"]["n"] == 2
    cfg.update(extra=dict(x=1))
    assert isinstance(cfg.extra, Config)
    assert isinstance(cfg.setdefault("more", {"y": 2}), Config)
    del cfg.extra
    assert "extra" not in cfg


def test_missing_attribute_names_the_nearest_key_and_stays_an_attribute_error():
    cfg = Config(train_cfg=dict(max_epochs=3))
    with pytest.raises(AttributeError, match="no key 'train_cgf': did you mean 'train_cfg'"):
        _ = cfg.train_cgf
    assert not hasattr(cfg, "val_cfg")
    assert getattr(cfg, "val_cfg", None) is None


def test_to_dict_copy_deepcopy_and_pickle():
    cfg = Config(a=dict(b=[dict(c=1)]), t=(1, dict(d=2)), cls=torch.optim.SGD)
    plain = cfg.to_dict()
    assert type(plain) is dict and type(plain["a"]) is dict and type(plain["a"]["b"][0]) is dict
    assert type(plain["t"][1]) is dict
    assert plain == cfg and plain["cls"] is torch.optim.SGD
    assert isinstance(cfg.copy(), Config) and isinstance(copy.copy(cfg), Config)
    deep = copy.deepcopy(cfg)
    deep.a.b[0].c = 9
    assert cfg.a.b[0].c == 1 and isinstance(deep.a, Config)
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and isinstance(back.a.b[0], Config)


# -- Python files ----------------------------------------------------------------------------------
def test_python_file_keeps_values_and_drops_imports_helpers_and_definitions(tmp_path):
    path = write(
        tmp_path,
        "cfg.py",
        """
        import math
        import torch.nn as nn
        from torch.optim import SGD
        from functools import partial

        _lr = 0.01

        def scaled(x):
            return x * 2

        class Net(nn.Module):
            pass

        model = dict(type=Net, width=scaled(8), act=nn.ReLU)
        optim_wrapper = dict(optimizer=dict(type=SGD, lr=_lr, momentum=math.sqrt(0.81)))
        """,
    )
    cfg = Config.fromfile(path)
    assert list(cfg) == ["model", "optim_wrapper"]
    assert cfg.optim_wrapper.optimizer.type is torch.optim.SGD
    assert cfg.optim_wrapper.optimizer.lr == 0.01
    assert cfg.optim_wrapper.optimizer.momentum == pytest.approx(0.9)
    assert cfg.model.width == 16 and cfg.model.act is torch.nn.ReLU
    assert cfg.model.type.__name__ == "Net"


def test_an_imported_name_rebound_by_assignment_is_a_key(tmp_path):
    # The seed's FSDP snippet: an imported function rebound to a partial is the user's value.
    path = write(
        tmp_path,
        "cfg.py",
        """
        from functools import partial
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
        size_based_auto_wrap_policy = partial(size_based_auto_wrap_policy, min_num_params=1e7)
        strategy = dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=size_based_auto_wrap_policy))
        """,
    )
    cfg = Config.fromfile(path)
    assert set(cfg) == {"size_based_auto_wrap_policy", "strategy"}
    assert cfg.strategy.model_wrapper.auto_wrap_policy.keywords == {"min_num_params": 1e7}


def test_config_can_import_a_module_next_to_it(tmp_path):
    write(tmp_path, "my_layers_for_cfg_test.py", "class Block:\n    depth = 4\n")
    path = write(tmp_path, "cfg.py", "from my_layers_for_cfg_test import Block\nmodel = dict(type=Block)\n")
    cfg = Config.fromfile(path)
    assert cfg.model.type.depth == 4 and list(cfg) == ["model"]


# -- _base_ ----------------------------------------------------------------------------------------
def test_base_chain_mixes_python_and_yaml_and_honours_delete(tmp_path):
    write(
        tmp_path,
        "base.py",
        """
        from torch.optim import SGD
        optim_wrapper = dict(type='OptimWrapper', optimizer=dict(type=SGD, lr=0.1, momentum=0.9),
                             clip_grad=dict(max_norm=1.0))
        train_cfg = dict(by_epoch=True, max_epochs=12)
        param_scheduler = [dict(type='LinearLR', end=5), dict(type='CosineAnnealingLR', T_max=12)]
        """,
    )
    (tmp_path / "sub").mkdir()
    write(
        tmp_path,
        "sub/mid.yaml",
        """
        _base_: ../base.py
        _defaults: &loader {batch_size: 2, num_workers: 0}
        train_dataloader:
          <<: *loader
          dataset: {type: ShapesDataset, size: 64}
        train_cfg: {max_epochs: 24}
        """,
    )
    path = write(
        tmp_path,
        "sub/child.py",
        """
        _base_ = ['mid.yaml']
        from torch.optim import AdamW
        optim_wrapper = dict(optimizer=dict(_delete_=True, type=AdamW, lr=1e-3))
        param_scheduler = [dict(type='LinearLR', end=2)]
        train_dataloader = dict(dataset=dict(size=32))
        """,
    )
    cfg = Config.fromfile(path)
    # _delete_ replaced the optimizer dict (momentum is gone) but the wrapper itself still merged.
    assert cfg.optim_wrapper.to_dict() == {
        "type": "OptimWrapper",
        "optimizer": {"type": torch.optim.AdamW, "lr": 1e-3},
        "clip_grad": {"max_norm": 1.0},
    }
    assert cfg.train_cfg == {"by_epoch": True, "max_epochs": 24}  # dicts merge recursively
    assert cfg.param_scheduler == [{"type": "LinearLR", "end": 2}]  # lists replace
    assert cfg.train_dataloader == {
        "batch_size": 2,
        "num_workers": 0,
        "dataset": {"type": "ShapesDataset", "size": 32},
    }
    assert "_base_" not in cfg and "_defaults" not in cfg
    assert list(cfg) == ["optim_wrapper", "train_cfg", "param_scheduler", "train_dataloader"]


def test_bases_merge_in_order_then_the_file_on_top(tmp_path):
    write(tmp_path, "a.yaml", "model: {type: A, depth: 1, width: 8}\nwork_dir: a\n")
    write(tmp_path, "b.py", "model = dict(type='B', depth=2)\n")
    path = write(tmp_path, "c.py", "_base_ = ['a.yaml', 'b.py']\nmodel = dict(depth=3)\n")
    assert Config.fromfile(path).to_dict() == {
        "model": {"type": "B", "depth": 3, "width": 8},
        "work_dir": "a",
    }


def test_delete_marker_never_survives(tmp_path):
    path = write(tmp_path, "c.py", "model = dict(_delete_=True, type='A', head=dict(_delete_=False, n=1))\n")
    assert Config.fromfile(path).to_dict() == {"model": {"type": "A", "head": {"n": 1}}}
    merged = merge_dicts({"a": {"x": 1}}, {"a": {"_delete_": True, "y": [{"_delete_": True, "z": 1}]}})
    assert merged == {"a": {"y": [{"z": 1}]}}


def test_json_configs_load_as_mmengine_reads_them(tmp_path):
    """MMEngine reads .json configs too: bases, _delete_, {{_base_.name}} and '_' helpers as in YAML."""
    write(tmp_path, "base.py", "model = dict(type='A', depth=1, width=8)\nbackend_args = None\n")
    path = write(tmp_path, "c.json", '{"_base_": "base.py", "_note": 1, "model": {"depth": 3},'
                                     ' "loader": {"args": {{_base_.backend_args}}}}')
    assert Config.fromfile(path).to_dict() == {"model": {"type": "A", "depth": 3, "width": 8},
                                               "backend_args": None, "loader": {"args": None}}
    bad = write(tmp_path, "bad.json", '{"model": {"depth": 3,}\n}')
    with pytest.raises(ConfigError, match=r"config .*bad\.json line 1: Expecting property name"):
        Config.fromfile(bad)


# -- errors ----------------------------------------------------------------------------------------
def test_missing_base_names_the_file_that_referenced_it(tmp_path):
    path = write(tmp_path, "child.py", "_base_ = 'nope.py'\nmodel = dict()\n")
    with pytest.raises(ConfigError, match=r"child\.py: _base_ file 'nope\.py' not found") as e:
        Config.fromfile(path)
    assert "\n" not in str(e.value)


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "broken.py", "model = dict(\n    depth=2,,\n)\n")
    with pytest.raises(ConfigError, match=r"config .*broken\.py line 2: invalid syntax") as e:
        Config.fromfile(path)
    assert "\n" not in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "broken.yaml", "model: {type: A\nwork_dir: x\n")
    with pytest.raises(ConfigError, match=r"config .*broken\.yaml line 2"):
        Config.fromfile(path)


def test_error_while_running_the_file_names_the_line(tmp_path):
    path = write(tmp_path, "bad.py", "x = 1\nmodel = dict(depth=undefined_name)\n")
    with pytest.raises(ConfigError, match=r"bad\.py line 2: NameError: name 'undefined_name' is not defined"):
        Config.fromfile(path)


def test_base_cycle_missing_file_and_unknown_suffix(tmp_path):
    write(tmp_path, "a.py", "_base_ = 'b.py'\n")
    write(tmp_path, "b.py", "_base_ = 'a.py'\n")
    with pytest.raises(ConfigError, match=r"_base_ cycle: .*a\.py -> .*b\.py -> .*a\.py"):
        Config.fromfile(tmp_path / "a.py")
    with pytest.raises(ConfigError, match="not found"):
        Config.fromfile(tmp_path / "missing.py")
    write(tmp_path, "c.toml", "")
    with pytest.raises(ConfigError, match=r"unsupported suffix '\.toml' \(use \.py, \.yaml, \.yml or \.json\)"):
        Config.fromfile(tmp_path / "c.toml")
    write(tmp_path, "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        Config.fromfile(tmp_path / "list.yaml")


# -- merge_from_dict -------------------------------------------------------------------------------
def make_cfg() -> Config:
    return Config(
        optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
        param_scheduler=[dict(type="LinearLR", end=5), dict(type="CosineAnnealingLR", T_max=10)],
    )


def test_merge_from_dict_sets_nested_keys_list_items_and_creates_levels():
    cfg = make_cfg()
    cfg.merge_from_dict(
        {
            "optim_wrapper.accumulative_counts": 4,
            "optim_wrapper.optimizer.lr": 0.01,
            "param_scheduler.0.end": 10,
            "param_scheduler.1": dict(T_max=20),  # a dict merges into the list item
            "cfg.activation_checkpointing": ["backbone"],
        }
    )
    assert cfg.optim_wrapper.to_dict() == {
        "type": "OptimWrapper",
        "optimizer": {"type": "SGD", "lr": 0.01},
        "accumulative_counts": 4,
    }
    assert cfg.param_scheduler[0].end == 10
    assert cfg.param_scheduler[1] == {"type": "CosineAnnealingLR", "T_max": 20}
    cfg.merge_from_dict({"param_scheduler.1": dict(_delete_=True, type="StepLR", step_size=3)})
    assert cfg.param_scheduler[1] == {"type": "StepLR", "step_size": 3}
    assert isinstance(cfg.param_scheduler[1], Config)
    assert cfg.cfg.activation_checkpointing == ["backbone"]


def test_merge_from_dict_merges_dict_values_unless_delete():
    cfg = make_cfg()
    cfg.merge_from_dict({"optim_wrapper.optimizer": dict(momentum=0.9)})
    assert cfg.optim_wrapper.optimizer == {"type": "SGD", "lr": 0.1, "momentum": 0.9}
    cfg.merge_from_dict({"optim_wrapper.optimizer": dict(_delete_=True, type="AdamW")})
    assert cfg.optim_wrapper.optimizer == {"type": "AdamW"}


@pytest.mark.parametrize(
    "key, message",
    [
        ("param_scheduler.5.end", r"index 5 is out of range \('param_scheduler' has 2 items\)"),
        ("param_scheduler.first", r"'param_scheduler' is a list, so 'first' must be an index"),
        ("optim_wrapper.0", r"'optim_wrapper' is a dict, not a list"),
        ("optim_wrapper.type.name", r"'optim_wrapper.type' is a str \('OptimWrapper'\), not a dict or list"),
        ("optim_wrapper..lr", r"empty part"),
    ],
)
def test_merge_from_dict_errors_name_the_key(key, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg().merge_from_dict({key: 1})
