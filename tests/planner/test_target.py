"""What a CUDA target changes in the step the planner runs: torch's optimizers step with ``foreach``
on CUDA tensors (a parameter-sized temporary while they step), with the per-tensor loop on CPU ones;
the caching allocator is replayed; a step that reads tensor values is one clear error."""

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.model import BaseModel
from memfit.planner.devices import CUBLAS_WORKSPACE, CUDA_CONTEXT, MiB, gpu, this_cpu
from memfit.planner.fake import fake_process_group, measure_step
from memfit.planner.predict import on_target, predict

_LOADER = dict(batch_size=4, num_workers=0, dataset=dict(type="ShapesDataset", image_size=16, num_classes=2,
                                                         num_samples=8))


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


class _Chain(BaseModel):
    """Linear layers whose activations are 1.5 MiB each: the caching allocator carves them from 20 MiB
    segments; ``item`` reads a value in the step (a host sync)."""

    def __init__(self, item: bool = False):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(768, 768) for _ in range(6)])
        self.item = item

    def forward(self, x=None, mode="tensor", img=None, **_):
        out = self.layers((x if x is not None else img).flatten(1).float())  # img: 3 x 16 x 16 = 768
        if self.item and out.sum().item() > 1e30:
            out = out * 0
        return {"loss": out.square().mean()} if mode == "loss" else out


def _chain(item: bool = False) -> dict:
    with torch.device("meta"):
        model = _Chain(item)
    return dict(model=model, optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)))


def test_cuda_targets_replay_the_caching_allocator():
    """For a CUDA target the fake step's allocations are replayed on the caching allocator's model: the
    reserved peak is whole segments (2 MiB multiples), above the allocated peak, which holds the cuBLAS
    workspaces and every block rounded; a CPU target simulates nothing."""
    batch = (torch.randn(512, 768),)
    with fake_process_group(1):
        cuda = measure_step(_chain(), full=True, batch=batch, cuda=True)
        cpu = measure_step(_chain(), full=True, batch=batch)
    assert cpu.cuda_allocated == cpu.cuda_reserved == 0
    assert cuda.cuda_reserved % (2 * MiB) == 0
    assert cuda.cuda_reserved >= cuda.cuda_allocated >= cuda.peak + CUBLAS_WORKSPACE
    # The predicted figures of the configured (measured) row are the simulated allocator's.
    pred = predict({**_chain(), "train_dataloader": _LOADER}, device=gpu("H100"), as_is=True)
    r = pred.results[0]
    assert r.reserved % (2 * MiB) == 0 and r.reserved >= r.allocated
    assert r.breakdown["allocator_slack"] == r.reserved - r.allocated
    assert r.peak_bytes == r.reserved + CUDA_CONTEXT


def test_a_step_that_reads_tensor_values_is_one_clear_error():
    from torch.optim import optimizer as optim_module

    def global_hooks() -> tuple[int, int]:
        return len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)

    before = global_hooks()
    with fake_process_group(1), pytest.raises(ConfigError, match=r"reads tensor values on the host .*at "
                                              r"test_target\.py:\d+.*memfit bench"):
        measure_step(_chain(item=True), full=True, batch=(torch.randn(4, 768),))
    # The failed step left no global optimizer hook behind (the fake step registers its phase and op-count
    # hooks for every optimizer in the process), and a later real optimizer step runs as usual.
    assert global_hooks() == before
    w = nn.Parameter(torch.ones(2))
    w.grad = torch.full((2,), 0.25)
    torch.optim.SGD([w], lr=1.0).step()
    assert w.tolist() == [0.75, 0.75]
