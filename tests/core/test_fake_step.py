"""The train step runs on fake tensors (no host sync inside it): what the planner will rely on."""

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure import MemoryTracker
from memfit.model import BaseModel
from memfit.optim import AmpOptimWrapper, OptimWrapper


class MLP(BaseModel):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x, y, mode="tensor"):
        out = self.net(x)
        return {"loss": nn.functional.cross_entropy(out.float(), y)} if mode == "loss" else out


def _peak(fake: bool, wrapper_cls) -> int:
    """Peak bytes of 4 micro-steps (2 optimizer steps, so Adam's state is included)."""
    torch.manual_seed(0)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with torch.device("meta") if fake else contextlib.nullcontext():
        model = MLP()
    with mode:
        if fake:
            model = model.to_empty(device="cpu")
        kw = {"dtype": "bfloat16"} if wrapper_cls is AmpOptimWrapper else {}
        wrapper = wrapper_cls(torch.optim.AdamW(model.parameters(), lr=1e-3), accumulative_counts=2, **kw)
        wrapper.initialize_count_status(model, 0, 4)
        batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
        with MemoryTracker(model, wrapper.optimizer) as t:
            for _ in range(4):
                log_vars = model.train_step(batch, wrapper)
        assert set(log_vars) == {"loss"}
    return t.peak_bytes


def test_train_step_on_fake_tensors_predicts_the_real_peak():
    for wrapper_cls in (OptimWrapper, AmpOptimWrapper):
        real, fake = _peak(False, wrapper_cls), _peak(True, wrapper_cls)
        assert fake == real, (wrapper_cls.__name__, fake, real)
