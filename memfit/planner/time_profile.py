"""Step-time profiles: the step-time model's factors measured on one GPU class (``memfit bench --calibrate``).

A profile is a small JSON file in ``memfit/planner/profiles/`` (dropping one there activates it). Its factors
are relative to the planner's table entry of the GPU measured (:data:`memfit.planner.devices.GPUS`): achieved
TFLOP/s over the data sheet's peak, achieved bandwidth over the table's, so one GPU's profile applies to another
GPU of the same family with that GPU's own data-sheet numbers. :func:`profile_for` picks a target's profile:
its own, else the nearest measured one (same family, else the nearest generation), else :data:`DEFAULT`,
which holds no factors: the model's constants (``Device.efficiency``, ``Device.launch_us``, ``LEVER_FACTORS``).

The factors (``"factors"`` in the file; any may be left out, the constant then applies):

- ``matmul``, ``conv``, ``conv_channels_last``: {dtype: fraction of the peak TFLOP/s}, per plan precision
  (``fp32``, ``tf32``, ``bf16``, ``fp16``); an fp32 convolution's is of the TF32 peak (cuDNN's default);
- ``attention``: the same for ``scaled_dot_product_attention`` (recorded; its FLOPs are costed as matmul's);
- ``memory_bound``: the bandwidth of the ``2 x bytes written / mem_bw`` term, x the table's;
- ``launch_us``: host seconds per dispatched operator (eager, forward and backward), in microseconds;
- ``host_bw``: host<->device copies (pinned), x the table's; ``link_bw``: null (one GPU cannot measure it);
- ``optimizer_foreach_passes``, ``optimizer_fused_passes``: an optimizer step's seconds in passes over its
  state; ``optimizer_foreach_op_us``: foreach's fixed cost per dispatched operator; ``optimizer_fused_tensor_us``:
  fused's per parameter tensor it steps (its host work; it launches a few kernels);
- ``host_step_gbps``: an offloaded optimizer's step on the host CPU, GB/s of the state it touches;
- ``fsdp_tensor_us``: FSDP2's host work per parameter tensor each time it gathers or reduces it (not measured by
  the calibration: :data:`memfit.planner.cost.FSDP_TENSOR_US` unless a profile sets it);
- ``selective_op_us``: selective checkpointing's host cost per operator its recomputation runs (its policy sees
  every operator of the region), beyond plain checkpointing's;
- ``host_op_factor``: a training step's host cost per operator over ``launch_us`` (a small ViT's forward and
  backward; :data:`memfit.planner.cost.HOST_OP_FACTOR`, fitted to real steps, unless a profile sets it);
- ``recompute_op_factor``, ``model_memory_bound`` (not measured by the calibration: fitted to real steps,
  :data:`memfit.planner.cost.RECOMPUTE_OP_FACTOR` and its neighbour unless a profile sets them): a recomputed
  operator's extra, in operators; the share of ``memory_bound`` that a model's FLOP-less kernels reach;
- any key of :data:`memfit.planner.cost.LEVER_FACTORS` (a number): replaces that lever's factor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError
from memfit.planner.devices import Device

PROFILE_DIR = Path(__file__).with_name("profiles")
FORMAT = 1
# Compute capability by family, for the nearest profile of another family.
GENERATIONS = {"volta": 7.0, "turing": 7.5, "ampere": 8.0, "ada": 8.9, "hopper": 9.0, "blackwell": 10.0}


@dataclass(frozen=True, eq=False)
class Profile:
    """One GPU class's factors (see the module docstring). ``name``: the table entry measured ('H100');
    ``gpu``: the name CUDA reports; ``meta``: versions, date and the raw measurements."""

    name: str
    gpu: str = ""
    family: str = ""
    factors: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def efficiency(self, kind: str, dtype: str, default: float) -> float:
        """The fraction of the peak that ``kind`` (matmul, conv, conv_channels_last) reaches in ``dtype``."""
        value = (self.factors.get(kind) or {}).get(dtype)
        return default if value is None else float(value)

    def has(self, kind: str, dtype: str) -> bool:
        return (self.factors.get(kind) or {}).get(dtype) is not None

    def number(self, key: str, default: float) -> float:
        """A scalar factor, or ``default`` where the profile has none."""
        value = self.factors.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "gpu": self.gpu, "family": self.family, **self.meta,
                "factors": self.factors}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "profile") -> Profile:
        """A profile from its JSON document; a wrong format or missing key is an error naming ``source``."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"{source}: not a step-time profile of format {FORMAT} (written by "
                              "`memfit bench --calibrate`)")
        missing = [k for k in ("name", "family", "factors") if k not in data]
        if missing or not isinstance(data["factors"], dict):
            raise ConfigError(f"{source}: a step-time profile needs name, family and factors (missing: {missing})")
        meta = {k: v for k, v in data.items() if k not in ("format", "name", "gpu", "family", "factors")}
        return cls(data["name"], data.get("gpu", ""), data["family"], data["factors"], meta)


DEFAULT = Profile("default")


def load(path: str | Path) -> Profile:
    """The profile in a JSON file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc})") from exc
    return Profile.from_json(data, str(path))


@lru_cache(maxsize=4)
def installed(directory: Path = PROFILE_DIR) -> tuple[Profile, ...]:
    """The profiles in ``directory`` (the package's ``profiles/``), by file name."""
    return tuple(load(p) for p in sorted(Path(directory).glob("*.json")))


def _distance(profile: Profile, device: Device) -> tuple[float, float]:
    """How far ``profile``'s GPU is from ``device``: another family first (by generation), then the peak."""
    gens = GENERATIONS.get(profile.family), GENERATIONS.get(device.family)
    family = 0.0 if profile.family == device.family else abs(gens[0] - gens[1]) + 0.01
    peak = profile.meta.get("peak_tflops", {}).get("bf16") or 0.0
    ours = device.dtype_tflops("bf16") or device.dtype_tflops("fp16") or 0.0
    return family, abs(math.log(peak / ours)) if peak > 0 and ours > 0 else math.inf


def profile_for(device: Device, profiles: tuple[Profile, ...] | None = None) -> tuple[Profile, bool]:
    """``device``'s profile and whether it is its own: the profile measured on it (its table name or the name
    CUDA reports), else the nearest (same family, else the nearest generation), else :data:`DEFAULT`. CPU
    targets and GPUs of no known family take :data:`DEFAULT` (a CPU target measures its own speeds)."""
    if not device.cuda:
        return DEFAULT, False
    profiles = installed() if profiles is None else profiles
    own = next((p for p in profiles if device.name in (p.name, p.gpu)), None)
    if own is not None:
        return own, True
    known = [p for p in profiles if p.family == device.family or
             (p.family in GENERATIONS and device.family in GENERATIONS)]
    if not known:
        return DEFAULT, False
    return min(known, key=lambda p: _distance(p, device)), False


def describe(device: Device, profiles: tuple[Profile, ...] | None = None) -> str | None:
    """One line saying which profile times ``device`` when it is not the device's own, else None."""
    profile, exact = profile_for(device, profiles)
    if exact or profile is DEFAULT:
        return None
    return f"time model: {profile.name} profile (nearest to {device.name}, which has none of its own)"
