"""--cfg-options parsing: the value table, the seed's efficient_conv_bn_eval="[backbone]", errors."""

from __future__ import annotations

import shlex

import pytest

from memfit.config import Config, parse_cfg_options, parse_value
from memfit.errors import ConfigError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1", 1),
        ("-3", -3),
        ("1e-3", 1e-3),
        ("0.5", 0.5),
        ("True", True),
        ("true", True),
        ("FALSE", False),
        ("None", None),
        ("none", None),
        ("abc", "abc"),
        ("'abc'", "abc"),
        ("[1,2]", [1, 2]),
        ("[1, 2.5, 'x']", [1, 2.5, "x"]),
        ("(1,2)", (1, 2)),
        ("(1,)", (1,)),
        ("1,2", [1, 2]),
        ("a,b", ["a", "b"]),
        ("(1,2),(3,4)", [(1, 2), (3, 4)]),
        ("[backbone]", ["backbone"]),
        ('"[backbone]"', ["backbone"]),  # quotes a shell did not strip: one level goes
        ("\"'[backbone]'\"", "[backbone]"),  # quote twice to keep the string
        ("[backbone, neck]", ["backbone", "neck"]),
        ("[backbone.layers.0,backbone.layers.1]", ["backbone.layers.0", "backbone.layers.1"]),
        ("[[a,b],[c]]", [["a", "b"], ["c"]]),
        ("[[backbone.layers.0],[1]]", [["backbone.layers.0"], [1]]),
        ("[a.b]", ["a.b"]),
        ("[]", []),
        ("dict(x=1)", {"x": 1}),
        ("dict(type=AdamW, lr=1e-3, betas=(0.9,0.99))", {"type": "AdamW", "lr": 1e-3, "betas": (0.9, 0.99)}),
        ("{'a': [true, none]}", {"a": [True, None]}),
        ("backbone.layers.0", "backbone.layers.0"),
        ("./work_dirs/run-1", "./work_dirs/run-1"),
        ("", ""),
        ("a=b", "a=b"),
        # Numbers as MMEngine's DictAction reads them (int(), float()): no hexadecimal, octal or complex.
        ("0x0", "0x0"),  # an HxW shape, not the hexadecimal 0
        ("0x10", "0x10"),
        ("[1, 0x2]", [1, "0x2"]),
        ("0b1", "0b1"),
        ("1j", "1j"),
        ("1_000", 1000),
        ("007", 7),
    ],
)
def test_value_table(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_items_parse_into_dotted_keys_later_wins():
    items = ["a.b=1", "c=[1,2]", "e=True", "f=None", "g=1e-3", "h=abc", "i=(1,2)", "j=dict(x=1)", "a.b=2"]
    assert parse_cfg_options(items) == {
        "a.b": 2,
        "c": [1, 2],
        "e": True,
        "f": None,
        "g": 1e-3,
        "h": "abc",
        "i": (1, 2),
        "j": {"x": 1},
    }


def test_seed_command_line_reaches_the_config():
    # memfit train CFG --cfg-options efficient_conv_bn_eval="[backbone]" optim_wrapper.accumulative_counts=4
    argv = shlex.split('efficient_conv_bn_eval="[backbone]" optim_wrapper.accumulative_counts=4')
    cfg = Config(optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)))
    cfg.merge_from_dict(parse_cfg_options(argv))
    assert cfg.efficient_conv_bn_eval == ["backbone"]
    assert cfg.optim_wrapper == {"optimizer": {"type": "SGD", "lr": 0.01}, "accumulative_counts": 4}


@pytest.mark.parametrize("item", ["abc", "=1", " =1"])
def test_item_without_key_or_equals_is_an_error(item):
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        parse_cfg_options([item])
