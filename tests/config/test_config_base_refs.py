"""A config reads its bases' values as MMEngine's Config lets it: ``{{_base_.name}}`` in any format, and ``_base_``
itself while a Python config runs; bad references are one line naming the file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from memfit.config import Config, parse_cfg_options, validate_config
from memfit.errors import ConfigError


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_braced_references_take_a_copy_of_the_bases_value_in_python_and_yaml(tmp_path):
    write(tmp_path, "base.py", """
        backend_args = dict(backend='local')
        model = dict(type='A', backbone=dict(depth=50, widths=[64, 128]))
        """)
    py = write(tmp_path, "child.py", """
        _base_ = 'base.py'
        loader = dict(args={{_base_.backend_args}}, widths={{ _base_.model.backbone.widths }})
        """)
    yml = write(tmp_path, "child.yaml", "_base_: base.py\nloader: {args: {{_base_.backend_args}}, depth: "
                                        "{{_base_.model.backbone.depth}}}\n")
    cfg = Config.fromfile(py)
    assert cfg.loader.to_dict() == {"args": {"backend": "local"}, "widths": [64, 128]}
    cfg.merge_from_dict(parse_cfg_options(["loader.widths.0=32", "loader.args.backend=s3"]))
    assert cfg.model.backbone.widths == [64, 128] and cfg.backend_args.backend == "local"  # copies
    assert Config.fromfile(yml).loader.to_dict() == {"args": {"backend": "local"}, "depth": 50}


def test_a_python_config_reads_base_while_it_runs_through_a_chain(tmp_path):
    write(tmp_path, "a.py", "max_epochs = 12\npipeline = [dict(type='Load'), dict(type='Resize'), dict(type='Pack')]\n")
    write(tmp_path, "b.py", "_base_ = ['a.py']\nmax_epochs = _base_.max_epochs + 1\n")
    path = write(tmp_path, "c.py", """
        _base_ = ['b.py']
        max_epochs = _base_.max_epochs * 2
        pipeline = [*_base_.pipeline[:1], dict(type='Flip'), *_base_.pipeline[1:]]
        train = dict(pipeline=_base_.pipeline)
        """)
    cfg = Config.fromfile(path)
    assert cfg.max_epochs == 26
    assert [t["type"] for t in cfg.pipeline] == ["Load", "Flip", "Resize", "Pack"]
    cfg.merge_from_dict({"train.pipeline.0.type": "Other"})
    assert cfg.pipeline[0].type == "Load"  # not aliased to the key it was read from
    assert "_base_" not in cfg


def test_mmdetection_style_bases_load_and_validate(tmp_path):
    """MMDetection's dataset base aliases test_dataloader to val_dataloader and its configs pass backend_args
    down with {{_base_.backend_args}}: the two loaders stay separate keys."""
    write(tmp_path, "_base_/datasets/coco.py", """
        backend_args = None
        data_root = 'data/coco/'
        val_dataloader = dict(batch_size=1, dataset=dict(type='CocoDataset', data_root=data_root,
                              pipeline=[dict(type='LoadImageFromFile', backend_args=backend_args)]))
        test_dataloader = val_dataloader
        """)
    path = write(tmp_path, "det/cfg.py", """
        _base_ = ['../_base_/datasets/coco.py']
        train_pipeline = [dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
                          dict(type='PackDetInputs')]
        val_dataloader = dict(batch_size=2)
        """)
    cfg = Config.fromfile(path)
    validate_config(cfg)
    assert cfg.train_pipeline[0].backend_args is None
    assert cfg.val_dataloader.batch_size == 2 and cfg.test_dataloader.batch_size == 1


@pytest.mark.parametrize(("text", "message"), [
    ("_base_ = 'base.py'\nx = {{_base_.modl}}\n", r"child\.py: \{\{_base_\.modl\}\}: no key 'modl' in the _base_ "
                                                   r"configs$"),
    ("_base_ = 'base.py'\nx = {{_base_.model.dept}}\n", r"\{\{_base_\.model\.dept\}\}: no key 'dept' in "
                                                        r"_base_\.model$"),
    ("_base_ = 'base.py'\nx = 'a' + {{_base_.name}}\n", r"\{\{_base_\.name\}\} must stand as a whole value.*"
                                                        r"write _base_\.name there\)$"),
    ("_base_ = 'base.py'\nx = _base_.modl\n", r"child\.py line 2: AttributeError: config has no key 'modl': did "
                                              r"you mean 'model'\?$"),
    ("name = 'base'\n_base_ = [name + '.py']\n", r"child\.py line 2: _base_ must be a file name or a list of file "
                                                 r"names written out, not computed \(NameError"),
])
def test_bad_references_are_one_line_naming_the_file(tmp_path, text, message):
    write(tmp_path, "base.py", "name = 'n'\nmodel = dict(depth=50)\n")
    path = write(tmp_path, "child.py", text)
    with pytest.raises(ConfigError, match=message) as e:
        Config.fromfile(path)
    assert "\n" not in str(e.value)
