"""FSDP1's arguments under FSDP2: MMEngine's ``FSDPStrategy`` / ``MMFullyShardedDataParallel`` options
that have no FSDP2 switch, and MMEngine's ``state_dict_cfg``.

An option set to what FSDP2 always does (``use_orig_params=True``, ``backward_prefetch=BACKWARD_PRE``)
is accepted silently; any other value logs one warning naming it (:func:`memfit.errors.warn_ignored`).
A ``state_dict_cfg`` memfit cannot read is a one-line ConfigError. :class:`FSDPStrategy` calls these.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.errors import ConfigError, did_you_mean, warn_ignored

_FSDP2_FIXED = {  # key: (the value FSDP2 always behaves as, why another value has no effect)
    "use_orig_params": (True, "FSDP2 always keeps the original parameters (as DTensor shards)"),
    "limit_all_gathers": (True, "FSDP2 always bounds the all-gathers in flight (it needs no rate limiter)"),
    "forward_prefetch": (False, "FSDP2 overlaps each unit's all-gather with the previous unit's forward "
                                "itself; FSDP1's earlier CPU-side issue is not applied"),
    "backward_prefetch": ("BACKWARD_PRE", "FSDP2 always prefetches the next unit before each unit's backward "
                                          "(BACKWARD_PRE) and cannot turn that off"),
}
# MMEngine's state_dict_cfg strings and FSDP1 StateDictType names -> memfit's state_dict_type.
_STATE_DICT_TYPES = {"local": "sharded", "sharded": "sharded", "full": "full", "LOCAL_STATE_DICT": "sharded",
                     "SHARDED_STATE_DICT": "sharded", "FULL_STATE_DICT": "full"}


def warn_fsdp1_only(wrapper: dict) -> None:
    """Warn (once) for each FSDP1 ``model_wrapper`` option set to something FSDP2 or memfit cannot do."""
    for key, (native, why) in _FSDP2_FIXED.items():
        value = wrapper.get(key, native)
        value = getattr(value, "name", value)  # FSDP1's BackwardPrefetch enum
        value = value.upper() if isinstance(value, str) else value
        if (value != native) if isinstance(native, str) else (bool(value) != native):
            warn_ignored(f"FSDPStrategy.model_wrapper.{key}={value}", why)
    if wrapper.get("param_init_fn") is not None:
        warn_ignored("FSDPStrategy.model_wrapper.param_init_fn", "memfit builds the model with real parameters, "
                     "never on the meta device, and FSDP1 calls param_init_fn only to materialise meta modules")


def warn_device_id(device_id: Any, device: torch.device) -> None:
    """FSDP1's ``device_id``: memfit runs each process on the device of its LOCAL_RANK; warn if it differs."""
    if device_id is None:
        return
    wanted = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if wanted.type != device.type or wanted.index not in (None, device.index):
        warn_ignored(f"FSDPStrategy.model_wrapper.device_id={device_id!r}",
                     f"each process uses the device of its LOCAL_RANK (here {device})")


def state_dict_type_from(cfg: Any) -> str:
    """MMEngine's ``state_dict_cfg``: 'local'/'full', or dict(state_dict_type='FULL_STATE_DICT', ...)."""
    valid = ("use 'local' (sharded), 'full', or dict(state_dict_type='SHARDED_STATE_DICT'|'LOCAL_STATE_DICT'|"
             "'FULL_STATE_DICT')")
    key = "FSDPStrategy.state_dict_cfg"
    if isinstance(cfg, dict):
        unknown = sorted(set(cfg) - {"state_dict_type", "state_dict_config", "optim_state_dict_config"})
        if unknown:
            raise ConfigError(f"{key}: unknown key {unknown[0]!r}: use state_dict_type, state_dict_config, "
                              "optim_state_dict_config")
        key, cfg = f"{key}.state_dict_type", cfg.get("state_dict_type", "local")
    name = getattr(cfg, "name", cfg)  # FSDP1's StateDictType enum
    if not isinstance(name, str) or name not in _STATE_DICT_TYPES:
        close = did_you_mean(str(name), _STATE_DICT_TYPES)
        raise ConfigError(f"{key}={cfg!r}: {valid}" + (f" ({close})" if close.startswith("did") else ""))
    return _STATE_DICT_TYPES[name]
