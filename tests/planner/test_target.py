"""What a CUDA target changes in the step the planner runs: torch's optimizers step with ``foreach``
on CUDA tensors (a parameter-sized temporary while they step), with the per-tensor loop on CPU ones."""

import torch
from torch import nn

from memfit.planner.devices import gpu, this_cpu
from memfit.planner.fake import fake_process_group, measure_step
from memfit.planner.predict import on_target


def _cfg(**optimizer):
    return dict(model=None, optim_wrapper=dict(type="OptimWrapper", optimizer=optimizer))


def test_cuda_targets_step_with_foreach_unless_the_config_chose():
    h100 = gpu("H100")
    assert on_target(_cfg(type="AdamW", lr=1e-3), h100)["optim_wrapper"]["optimizer"]["foreach"] is True
    assert on_target(_cfg(type="SGD", lr=0.1), h100)["optim_wrapper"]["optimizer"]["foreach"] is True
    for chosen in (dict(foreach=False), dict(fused=True)):
        assert on_target(_cfg(type="AdamW", lr=1e-3, **chosen), h100)["optim_wrapper"]["optimizer"] == \
            dict(type="AdamW", lr=1e-3, **chosen)
    assert "foreach" not in on_target(_cfg(type="AdamW", lr=1e-3), this_cpu())["optim_wrapper"]["optimizer"]

    class Plain(torch.optim.SGD):  # no foreach argument: left alone
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)

    assert "foreach" not in on_target(_cfg(type=Plain), h100)["optim_wrapper"]["optimizer"]


def test_foreach_holds_a_parameter_sized_temporary_in_the_optimizer_phase():
    from memfit.model import BaseModel

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(128, 128) for _ in range(16)])

        def forward(self, x, mode="tensor"):
            return {"loss": self.layers(x).square().mean()} if mode == "loss" else self.layers(x)

    with torch.device("meta"):
        model = Net()
    params = sum(p.numel() * 4 for p in model.parameters())
    batch = (torch.randn(2, 128),)
    phases = {}
    for foreach in (False, True):
        cfg = dict(model=model, optim_wrapper=dict(type="OptimWrapper", optimizer=dict(
            type="AdamW", lr=1e-3, foreach=foreach)))
        with fake_process_group(1):
            phases[foreach] = measure_step(cfg, full=True, batch=batch).optimizer.peak
    # foreach AdamW takes the sqrt of every exp_avg_sq at once; the loop holds two temporaries of one
    # parameter at a time (each 1/16 of the parameters here).
    assert phases[True] - phases[False] >= 0.8 * params


def test_cuda_targets_cast_as_cuda_autocast():
    """Under AMP, CUDA autocast runs LayerNorm in fp32 (it keeps an fp32 copy of its bf16 input for the
    backward), CPU autocast in the input's dtype: the fake step for a CUDA target holds those bytes."""
    from memfit.model import BaseModel

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64)

        def forward(self, x, mode="tensor"):
            out = self.fc2(self.norm(self.fc1(x)))
            return {"loss": out.float().square().mean()} if mode == "loss" else out

    with torch.device("meta"):
        model = Net()
    rows = 512
    cfg = dict(model=model, optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16",
                                               optimizer=dict(type="SGD", lr=0.1)))
    with fake_process_group(1):
        cpu, cuda = (measure_step(cfg, full=False, batch=(torch.randn(rows, 64),), cuda=flag).forward_backward
                     for flag in (False, True))
    # CUDA: LayerNorm keeps an fp32 copy of its input (4 B) where CPU keeps fc1's bf16 output (2 B); its fp32
    # output is cast to bf16 for fc2 (the 2 B CPU keeps too) and freed: 2 B per LayerNorm element more.
    assert cuda.breakdown["activations"] - cpu.breakdown["activations"] >= 2 * rows * 256
    assert cuda.breakdown["parameters"] == cpu.breakdown["parameters"]
