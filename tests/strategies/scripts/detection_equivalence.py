"""Rank script: a tiny DINO (tests/fixtures/detection/dino_tiny.py) under FSDP2 on 2 ranks against one process.

Rank 0 first trains the one-process reference on the whole global batches, before any process group exists
(so DINO's ``sync_cls_avg_factor`` has nothing to all-reduce); then both ranks train the same model, from the
same seed, on their halves of the same batches: FSDP2, FSDP2 with activation checkpointing of the backbone
stages and the encoder layers, and FSDP2 with DINO's real denoising noise. Each records, per step, every
loss term averaged over the ranks, and rank 0 the largest difference of the gathered parameters from the
reference. The denoising noise is the model's only random draw (the fixture has no dropout or drop-path);
see tests/strategies/test_detection_distributed.py for how it is handled.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import memfit.model  # noqa: F401  (registers DINO, TimmBackbone, ChannelMapper, DetDataPreprocessor)
from memfit import dist
from memfit.config import Config
from memfit.connector import setup
from memfit.data import ShapesDataset
from memfit.memory.wrapping import wrapped_forward
from memfit.optim import OptimWrapper
from memfit.registry import MODELS
from memfit.strategies import FSDPStrategy
from memfit.testing import shapes_detection_batch, write_result

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "detection" / "dino_tiny.py"
STEPS, PER_RANK, WORLD, LR = 3, 2, 2, 1e-3
# Denoising noise this small leaves every noised box and label equal to its ground truth in fp32 (a shift of
# < 1e-12 of a normalised coordinate rounds away): the denoising queries are the same whatever the RNG draws.
QUIET = 1e-12
CHECKPOINTED = ["backbone.layers", "encoder.layers"]


def dino_cfg(noise: bool = False) -> dict:
    """The fixture's DINO config; ``noise=False``: the denoising noise scales set to ``QUIET``."""
    cfg = Config.fromfile(FIXTURE).to_dict()["model"]
    if not noise:
        cfg["dn_cfg"].update(label_noise_scale=QUIET, box_noise_scale=QUIET)
    return cfg


def build_dino(noise: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS.build(dino_cfg(noise), key="model")


def global_batches(steps: int = STEPS, per_rank: int = PER_RANK, world: int = WORLD) -> list[list[int]]:
    """``steps`` global batches of ShapesDataset(max_shapes=3) indices, rank r's share at ``[r * per_rank:]``.

    Every share starts with an image holding the most boxes (3): DINO pads each image's denoising queries to
    the batch's largest box count (and picks the number of groups from it), so a share whose largest count
    differed from the global batch's would give its images other denoising queries than one process does.
    """
    ds = ShapesDataset(num_samples=64, image_size=64, max_shapes=3, transform=[])
    counts = [len(ds[i]["labels"]) for i in range(len(ds))]
    full = iter([i for i, c in enumerate(counts) if c == 3])
    rest = iter([i for i, c in enumerate(counts) if c < 3])
    return [[i for _ in range(world) for i in (next(full), *(next(rest) for _ in range(per_rank - 1)))]
            for _ in range(steps)]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters (gathered from FSDP's shards), on every rank."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def param_diffs(state: dict, ref: dict) -> dict[str, float]:
    """Largest parameter differences: ``param_diff`` over everything but the attention key biases,
    ``key_bias_diff`` over those. A key bias adds ``q . b`` to every logit of a query's softmax alike, so its
    exact gradient is zero: the computed one is rounding noise, which Adam's ``m / sqrt(v)`` turns into steps
    of about ``lr`` in a direction that differs between any two summation orders."""
    key = {n: slice(len(t) // 3, 2 * len(t) // 3) for n, t in ref.items() if n.endswith("attn.in_proj_bias")}
    diff = {n: (state[n] - ref[n]).abs() for n in ref}
    out = {"param_diff": 0.0, "key_bias_diff": 0.0}
    for n, d in diff.items():
        if n in key:
            out["key_bias_diff"] = max(out["key_bias_diff"], float(d[key[n]].max()))
            d = torch.cat([d[:key[n].start], d[key[n].stop:]])
        out["param_diff"] = max(out["param_diff"], float(d.max()))
    return out


def train(model: torch.nn.Module, wrapper, batches: list[list[int]], rank: int, world: int) -> list[dict]:
    """Train on rank ``rank``'s share of each batch; every step's loss terms averaged over the ranks."""
    steps = []
    for indices in batches:
        share = len(indices) // world
        batch = shapes_detection_batch(indices[rank * share:(rank + 1) * share])
        log = model.train_step(batch, optim_wrapper=wrapper)
        steps.append({k: float(dist.all_reduce_mean(v.float())) if world > 1 else float(v) for k, v in log.items()})
    return steps


def reference(batches: list[list[int]]) -> tuple[list[dict], dict, dict]:
    """One process, no process group: (per-step losses, initial and trained parameters)."""
    model = build_dino()
    init = full_state(model)
    steps = train(model, OptimWrapper(torch.optim.AdamW(model.parameters(), lr=LR)), batches, 0, 1)
    return steps, init, full_state(model)


def fsdp_run(batches: list[list[int]], ref: dict | None, *, noise: bool = False,
             techniques: dict | None = None) -> dict:
    """FSDP2 on this rank's shares; rank 0 compares the gathered parameters with the reference's."""
    strategy = FSDPStrategy()  # its default units: DINO's repeated composite modules
    model, wrapper = setup(build_dino(noise), strategy, dict(optimizer=dict(type="AdamW", lr=LR)), techniques)
    wrapper.initialize_count_status(model, 0, -1)
    steps = train(model, wrapper, batches, dist.get_rank(), dist.get_world_size())
    state = full_state(model)
    out = dict(losses=steps, units=strategy.units,
               checkpointed=[n for n, m in model.named_modules() if wrapped_forward(m) is not None])
    if ref is not None:
        out.update(param_diffs(state, ref))
    return out


def main() -> None:
    torch.set_num_threads(1)
    batches = global_batches()
    rank = int(os.environ["RANK"])
    results: dict = {"batches": batches}
    ref = None
    if rank == 0:
        steps, init, ref = reference(batches)
        results["ref"] = dict(losses=steps, moved=max(float((ref[n] - init[n]).abs().max()) for n in ref))
    results["fsdp"] = fsdp_run(batches, ref)
    results["fsdp_ckpt"] = fsdp_run(batches, ref, techniques=dict(activation_checkpointing=CHECKPOINTED))
    results["fsdp_noise"] = fsdp_run(batches[:1], None, noise=True)
    results["world_size"] = dist.get_world_size()
    write_result(results)
    dist.barrier()  # no rank tears the group down while the other still uses it


if __name__ == "__main__":
    main()
