"""Auto-fit: train with the fastest predicted plan that fits a memory budget, with no OOM trials.

``memfit train CFG --auto-fit [BUDGET]`` or ``auto_fit=dict(budget='24GiB', gpus=8)`` in a config:
the planner predicts every plan at the run's world size (``gpus`` x ``nodes``, else the launch's
``WORLD_SIZE``), the fastest one within the budget less a 5% margin is verified by a whole fake step
and applied to the config, logged in one line and written to ``work_dir/auto_fit.json``. With
``compile=True`` it may pick a compiled plan (its memory is its eager plan's). The default
budget is the current GPU's free memory (the CPU's physical memory without one). If nothing fits, a
one-line error names the closest plan and its predicted peak.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError, did_you_mean
from memfit.planner.devices import Device, current_cuda, gpu, parse_bytes, this_cpu

AUTO_FIT_KEYS = ("budget", "gpus", "nodes", "gpu", "compile")


def target_device(name: str | None = None) -> Device:
    """A named GPU of the table, else this process's GPU, else this CPU."""
    import torch

    if name:
        return gpu(name)
    return current_cuda() if torch.cuda.is_available() else this_cpu()


def default_budget(device: Device) -> int:
    """Free memory of the current GPU (what this process can still get), else the target's memory."""
    import torch

    if device.cuda and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    return device.memory


def auto_fit_options(value: Any) -> dict[str, Any]:
    """``auto_fit`` as a dict: True, a budget ('24GiB') or dict(budget=..., gpus=..., nodes=..., gpu=...,
    compile=True)."""
    if value is True:
        return {}
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return {"budget": value}
    if not isinstance(value, dict):
        raise ConfigError(f"auto_fit={value!r}: use True, a budget such as '24GiB', or dict(budget='24GiB', gpus=8)")
    for key in value:
        if key not in AUTO_FIT_KEYS:
            raise ConfigError(f"auto_fit: unknown key {key!r}: {did_you_mean(key, AUTO_FIT_KEYS)}")
    return dict(value)


def apply_auto_fit(cfg: dict, value: Any = True) -> tuple[dict, str]:
    """``cfg`` with the recommended plan applied, and the line to log (see the module docstring)."""
    from memfit.planner.fake import build_meta_model
    from memfit.planner.predict import predict
    from memfit.planner.report import size
    from memfit.planner.space import ModelFacts

    options = auto_fit_options(value)
    device = target_device(options.get("gpu"))
    world = int(options.get("gpus", 0) or os.environ.get("WORLD_SIZE", 1)) * int(options.get("nodes", 1))
    budget = parse_bytes(options["budget"], "auto_fit.budget") if "budget" in options else default_budget(device)
    cfg = {k: v for k, v in cfg.items() if k != "auto_fit"}
    pred = predict(cfg, device=device, world_size=world, budget=budget, compile=bool(options.get("compile")))
    if pred.recommended is None:
        closest = min(pred.results, key=lambda r: r.peak_bytes)
        within = ", within the budget but not its margin" if closest.peak_bytes <= budget else ""
        raise ConfigError(f"auto_fit: no plan fits {size(budget)} per rank on {world} x {device.name}; the "
                          f"smallest is '{closest.plan.name}' at {size(closest.peak_bytes)}{within}: raise the "
                          "budget, add GPUs (auto_fit.gpus) or lower the batch size")
    best = pred.results[pred.recommended]
    facts = ModelFacts.of(build_meta_model(cfg["model"]))
    fitted = best.plan.apply(cfg, facts)
    line = (
        f"auto_fit: {best.plan.name} (predicted peak {size(best.peak_bytes)} of {size(budget)} per rank, "
        f"{best.rel_step_time:.2f}x the configured step time; {len(pred.results)} plans, {pred.seconds:.0f} s; "
        f"planned for {pred.input.describe()})"
        + "".join(f"; note: {n}" for n in pred.notes))
    work_dir = cfg.get("work_dir")
    if work_dir and int(os.environ.get("RANK", 0)) == 0:
        path = Path(work_dir) / "auto_fit.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**pred.to_json(), "applied": best.plan.as_dict()}, indent=1))
    return fitted, line


__all__ = ["apply_auto_fit", "auto_fit_options", "default_budget", "target_device"]
