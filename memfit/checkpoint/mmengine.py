"""Checkpoints written by MMEngine: read without executing their code, and put in memfit's layout.

An MMEngine checkpoint is ``{'meta', 'state_dict', 'optimizer', 'param_schedulers', 'message_hub'}``.
Beside tensors it pickles a few of MMEngine's own objects (the message hub's ``HistoryBuffer``, numpy
arrays inside it), which torch's ``weights_only`` loader refuses. memfit loads exactly those (globals
of the OpenMMLab packages and numpy) as inert :class:`Placeholder` objects that only store what the
pickle holds; nothing is called. Any other global (``os.system``, a user's class) is still refused.

:func:`from_mmengine` turns such a checkpoint into memfit's resume layout: the loop position from
``meta``, the optimizer state mapped by parameter name onto memfit's (merged) param groups, and the
scheduler states with their per-group lists mapped the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import CheckpointError

OPENMMLAB_PREFIXES = ("mmengine.", "mmcv.", "mmdet.", "mmpretrain.", "mmcls.", "mmseg.", "mmagic.")
FOREIGN_PREFIXES = (*OPENMMLAB_PREFIXES, "numpy.")
# numpy 2 pickles some scalars as ``getattr(dtype, name)``: read as a placeholder like the rest, never called.
FOREIGN_NAMES = ("builtins.getattr",)
# Per-param-group lists in an MMEngine scheduler state (``_ParamScheduler.__dict__``).
_GROUP_LISTS = ("base_values", "_last_value", "min_values", "max_values", "initial_values")


class Placeholder:
    """An object of a class memfit does not import: the pickle's arguments and state, kept as data."""

    qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<unread {self.qualified_name}>"


def unsafe_globals(path: str | Path) -> list[str]:
    """The globals ``path`` names outside torch's weights-only allowlist ([] when unreadable)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: the caller reports torch's own error
        return []


def is_foreign(name: str) -> bool:
    """A global of MMEngine's family or numpy: read as a placeholder."""
    return name.startswith(FOREIGN_PREFIXES) or name in FOREIGN_NAMES


def load_with_placeholders(path: str | Path, names: list[str], map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` with ``names`` allowed as :class:`Placeholder` classes."""
    stubs = [(type(n.rsplit(".", 1)[-1], (Placeholder,), {"qualified_name": n}), n) for n in names]
    with torch.serialization.safe_globals(stubs):
        return torch.load(path, map_location=map_location, weights_only=True)


def find_placeholder(obj: Any) -> str | None:
    """The class name of the first placeholder inside ``obj`` (None if there is none)."""
    if isinstance(obj, Placeholder):
        return obj.qualified_name
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    return next((found for v in items if (found := find_placeholder(v)) is not None), None)


def is_mmengine_checkpoint(state: dict) -> bool:
    meta = state.get("meta")
    return isinstance(meta, dict) and ("mmengine_version" in meta or "message_hub" in state) and "loop" not in state


def from_mmengine(state: dict, path: Path, model: nn.Module, wrapper: Any, *, by_epoch: bool,
                  iters_per_epoch: int) -> dict:
    """An MMEngine training checkpoint in memfit's resume layout (see :mod:`memfit.resume`)."""
    meta = state["meta"]
    epoch, it = int(meta.get("epoch", 0)), int(meta.get("iter", 0))
    loop = ({"epoch": epoch, "iter": it, "batch_in_epoch": 0} if by_epoch
            else {"epoch": it // iters_per_epoch, "iter": it, "batch_in_epoch": it % iters_per_epoch})
    out: dict[str, Any] = {"meta": {"mmengine_version": str(meta.get("mmengine_version")), "seed": meta.get("seed")},
                           "state_dict": state["state_dict"], "loop": loop}
    group_maps: dict[str, list[int] | None] = {}
    if wrapper is not None and "optimizer" in state:
        members = dict(wrapper.items()) if hasattr(wrapper, "optim_wrappers") else None
        if members is None:
            out["optim_wrapper"], group_maps[""] = _optimizer(state["optimizer"], path, model, wrapper, "optimizer")
        else:
            out["optim_wrapper"] = {}
            for name, sub in state["optimizer"].items():
                module = model.get_submodule(name) if name in members else model
                out["optim_wrapper"][name], group_maps[name] = _optimizer(sub, path, module, members.get(name),
                                                                          f"optimizer.{name}")
    if "param_schedulers" in state:
        scheds = state["param_schedulers"]
        _refuse_placeholders(scheds, path, "param_schedulers")
        if isinstance(scheds, dict):
            out["param_schedulers"] = {k: [_remap_groups(s, group_maps.get(k)) for s in v] for k, v in scheds.items()}
        else:
            out["param_schedulers"] = [_remap_groups(s, group_maps.get("")) for s in scheds]
    _refuse_placeholders(out, path, "the model, optimizer or meta")
    return out


def _refuse_placeholders(obj: Any, path: Path, where: str) -> None:
    found = find_placeholder(obj)
    if found is not None:
        raise CheckpointError(f"{path}: {where} holds an object of {found}, which memfit cannot restore without "
                              "running MMEngine's code: start from the weights with load_from instead of resume")


def _optimizer(saved: dict, path: Path, model: nn.Module, wrapper: Any, key: str) -> tuple[dict, list[int] | None]:
    """MMEngine's optimizer state (indexed in ``model.named_parameters()`` order, one group per parameter
    with paramwise_cfg) as memfit's wrapper state for ``wrapper``'s optimizer; and, per live group,
    the index of the saved group it takes its options from."""
    _refuse_placeholders(saved, path, key)
    saved = dict(saved)
    extras = {k: saved.pop(k) for k in ("base_param_settings", "loss_scaler") if k in saved}
    if wrapper is None:
        return extras, None
    names = [n for n, _ in model.named_parameters()]
    index_of = {n: i for i, n in enumerate(names)}
    saved_group_of = {i: g for g, group in enumerate(saved["param_groups"]) for i in group["params"]}
    if saved_group_of and max(saved_group_of) >= len(names):
        raise CheckpointError(f"{path}: {key} holds {max(saved_group_of) + 1} parameters, the model has "
                              f"{len(names)}: resume with the model that wrote it")
    live_name = {id(p): n for n, p in model.named_parameters()}
    state, groups, group_map, pos = {}, [], [], 0
    for group in wrapper.optimizer.param_groups:
        ids, first = [], None
        for p in group["params"]:
            j = index_of[live_name[id(p)]]
            if j not in saved_group_of:
                raise CheckpointError(f"{path}: {key} has no entry for parameter {live_name[id(p)]!r}")
            if j in saved["state"]:
                state[pos] = saved["state"][j]
            first = saved_group_of[j] if first is None else first
            ids.append(pos)
            pos += 1
        options = {k: v for k, v in saved["param_groups"][first].items() if k not in ("params", "param_names")}
        groups.append({**options, "params": ids, **({"param_names": group["param_names"]} if "param_names" in group
                                                     else {})})
        group_map.append(first)
    return {"optimizer": {"state": state, "param_groups": groups}, **extras}, group_map


def _remap_groups(sched: dict, group_map: list[int] | None) -> dict:
    """A scheduler state's per-group lists re-ordered onto the live groups (MMEngine has one group per
    parameter under paramwise_cfg, memfit one per distinct options); the base pseudo group stays last."""
    if group_map is None or not isinstance(sched, dict):
        return sched
    out = dict(sched)
    for key in _GROUP_LISTS:
        values = sched.get(key)
        if not isinstance(values, list) or not values:
            continue
        # With several saved groups the last entry is the base pseudo group; one group is its own base.
        mapped = [values[g] for g in group_map]
        out[key] = mapped + [values[-1]] if len(group_map) > 1 else mapped
    return out
