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
