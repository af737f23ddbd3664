"""Config files: load (.py/.yaml with ``_base_``), override (``--cfg-options``), validate and dump.

See docs/config.md for the file formats and rules.
"""

from memfit.config.dump import config_to_python, config_to_yaml, dump_config
from memfit.config.loader import Config, merge_dicts
from memfit.config.options import parse_cfg_options, parse_value
from memfit.config.schema import (
    CONFIG_KEYS,
    RUNNER_KEYS,
    SECTIONS,
    TECHNIQUE_KEYS,
    DataloaderCfg,
    EnvCfg,
    Randomness,
    TestCfg,
    TrainCfg,
    ValCfg,
    validate_config,
)

__all__ = [
    "CONFIG_KEYS",
    "RUNNER_KEYS",
    "SECTIONS",
    "TECHNIQUE_KEYS",
    "Config",
    "DataloaderCfg",
    "EnvCfg",
    "Randomness",
    "TestCfg",
    "TrainCfg",
    "ValCfg",
    "config_to_python",
    "config_to_yaml",
    "dump_config",
    "merge_dicts",
    "parse_cfg_options",
    "parse_value",
    "validate_config",
]
