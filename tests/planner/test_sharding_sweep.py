"""FSDP's per-rank model state on fake tensors at N = 8 ... 1024 ranks: 16 bytes per parameter / N for
AdamW in fp32 (4 parameter + 4 gradient + 8 Adam state), plus what FSDP2's padding adds.

FSDP2 shards every parameter on dim 0 in chunks of ceil(d0 / N) rows, padding the last ranks: rank 0
always holds a full chunk, so its shard of a d0 x k parameter is ceil(d0 / N) * k elements. The
model's four 4096 x 4096 layers divide evenly up to N = 4096; its 10-way head does not (rank 0 holds
ceil(10 / N) rows of 4096, not 10 / N), and that remainder is computed here, not fitted. One process
runs every N over a fake process group; fused AdamW leaves no temporaries in the optimizer phase
(the foreach implementation adds a state-sized one while it steps), so the phase's parameters,
gradients and optimizer state are the persistent model state.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.model import BaseModel
from memfit.planner.fake import fake_process_group, measure_step

WIDTH, LAYERS, CLASSES = 4096, 4, 10
BYTES_PER_PARAM = 16  # fp32 parameter, fp32 gradient, AdamW's exp_avg and exp_avg_sq


class Wide(BaseModel):
    """Four large Linear layers (67M parameters) and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, y=None, mode="tensor"):
        out = self.head(self.blocks(x))
        return {"loss": F.cross_entropy(out, y)} if mode == "loss" else out


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return Wide()


def shard_elements(model: nn.Module, world: int) -> int:
    """Elements of rank 0's FSDP2 shards: ceil(d0 / N) rows of every parameter."""
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.parameters())


@pytest.mark.parametrize("world", [2**k for k in range(3, 11)])
def test_fsdp_model_state_is_16_bytes_per_parameter_over_n(model, world):
    cfg = dict(model=model, strategy=dict(type="FSDPStrategy"),
               optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3, fused=True)))
    batch = (torch.randn(2, WIDTH), torch.randint(0, CLASSES, (2,)))
    with fake_process_group(world):
        m = measure_step(cfg, full=True, batch=batch)
    b = m.optimizer.breakdown
    state = b["parameters"] + b["gradients"] + b["optimizer_state"]

    params = sum(p.numel() for p in model.parameters())
    ideal = BYTES_PER_PARAM * params / world
    remainder = BYTES_PER_PARAM * shard_elements(model, world) - ideal  # FSDP2's padding on rank 0
    assert remainder >= 0
    assert abs(state - (ideal + remainder)) <= 0.01 * ideal, (world, state, ideal, remainder)
    # Each part on its own: 4 + 4 + 8 bytes per shard element.
    shard = shard_elements(model, world)
    for key, per_elem in (("parameters", 4), ("gradients", 4), ("optimizer_state", 8)):
        assert abs(b[key] - per_elem * shard) <= 0.01 * per_elem * shard, (world, key, b[key], per_elem * shard)
    # Without the padding the state falls as 1/N: N x (state - remainder) is the whole model's 16 B/param.
    assert abs(world * (state - remainder) / (BYTES_PER_PARAM * params) - 1) <= 0.01


def test_dtensor_shape_propagation_is_not_memory(model):
    """The first time DTensor meets an op it runs it on stand-ins of the global shape, in the active fake
    mode, to learn the output's shape: the tracker must not count them, so a step measures the same
    whether DTensor's caches are cold (the first FSDP step of a planner worker) or warm."""
    from torch.distributed.tensor import DTensor

    cfg = dict(model=model, strategy=dict(type="FSDPStrategy"),
               optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)))
    batch = (torch.randn(2, WIDTH), torch.randint(0, CLASSES, (2,)))
    propagator = DTensor._op_dispatcher.sharding_propagator
    with fake_process_group(4):
        propagator.propagate_op_sharding.cache_clear()
        propagator._propagate_tensor_meta_cached.cache_clear()
        cold = measure_step(cfg, full=True, batch=batch, steps=1)
        warm = measure_step(cfg, full=True, batch=batch, steps=1)
    assert cold.optimizer.breakdown == warm.optimizer.breakdown
    assert cold.peak == warm.peak
