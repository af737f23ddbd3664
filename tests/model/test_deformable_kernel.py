"""The Triton kernel of DINO's multi-scale deformable attention (``memfit::ms_deform_attn``), run on CPU in
Triton's interpreter: the same outputs and gradients as the ``grid_sample`` implementation, fp32 accumulation
for bf16/fp16 inputs, an fp64 gradcheck, and fake implementations that declare only the outputs (the planner
predicts the kernel path's memory from them).

Small shapes: the interpreter runs a program in ~0.1 s per level and point. Three levels of uneven shapes, a
channel count that is not a power of two (masked lanes), more queries than one block, locations a little
outside ``[0, 1]`` (zero padding at the borders, as ``grid_sample`` and MMCV's kernel)."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure.target import device_type_of, measured_for
from memfit.model.detection.dino.attention import MultiScaleDeformableAttention, multi_scale_deformable_attn

# Compiled on a GPU machine (CUDA tensors), interpreted elsewhere (CPU tensors).
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
SHAPES = ((4, 5), (2, 3), (1, 2))
FLAT = [n for hw in SHAPES for n in hw]


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU")


@pytest.fixture(autouse=True)
def _operator_registered():
    """``memfit::ms_deform_attn`` registered, as the attention registers it at its first kernel call: some tests call
    the operator itself, and must not depend on another test having run first in their process."""
    from memfit.model.detection.dino import deform_op  # noqa: F401


def _inputs(dtype=torch.float32, q=18, heads=2, d=3, points=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(h * w for h, w in SHAPES)
    value = torch.randn(b := 1, s, heads, d, generator=g).to(dtype)
    locations = torch.rand(b, q, heads, len(SHAPES), points, 2, generator=g) * 1.2 - 0.1
    weights = torch.rand(b, q, heads, len(SHAPES), points, generator=g).softmax(-1)
    return value.to(DEVICE), locations.to(DEVICE), weights.to(DEVICE)


def _run(impl, inputs, grad_out):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = multi_scale_deformable_attn(leaves[0], list(SHAPES), leaves[1], leaves[2], impl=impl)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def test_fp32_outputs_and_gradients_equal_grid_samples():
    inputs = _inputs()
    grad_out = torch.randn(1, 18, 6, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kernel, reference = _run("triton", inputs, grad_out), _run("pytorch", inputs, grad_out)
    torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("value", "locations", "weights"), kernel[1], reference[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")
    assert kernel[1][1].abs().sum() > 0 and (reference[0] != 0).all()  # the comparison compared something


# Both implementations compute in fp32 from the same rounded inputs and round once at the end: they differ by
# the rounding of fp32 results that differ in the order of the sums (~1e-6), i.e. by at most one unit in the
# last place of the output (bf16: 2**-8 relative, fp16: 2**-11). The locations' and weights' gradients stay fp32.
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)])
def test_half_inputs_read_as_they_are_and_accumulate_in_fp32(dtype, rtol):
    inputs = _inputs(dtype, q=5)
    grad_out = torch.randn(1, 5, 6, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kernel, reference = _run("triton", inputs, grad_out), _run("pytorch", inputs, grad_out)
    assert kernel[0].dtype == dtype and kernel[1][0].dtype == dtype and kernel[1][1].dtype == torch.float32
    torch.testing.assert_close(kernel[0], reference[0], rtol=rtol, atol=rtol)
    torch.testing.assert_close(kernel[1][0], reference[1][0], rtol=rtol, atol=rtol)
    torch.testing.assert_close(kernel[1][1], reference[1][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernel[1][2], reference[1][2], rtol=1e-4, atol=1e-4)


def test_gradcheck_in_fp64():
    """fp64 inputs accumulate in fp64, so finite differences check the kernel's backward formulas."""
    value, locations, weights = (t.double().requires_grad_() for t in _inputs(q=3, heads=1, d=2, points=1))
    assert torch.autograd.gradcheck(lambda v, loc, w: torch.ops.memfit.ms_deform_attn(v, FLAT, loc, w),
                                    (value, locations, weights), fast_mode=True)


def test_fake_implementations_declare_the_outputs_and_keep_only_the_inputs():
    """On fake tensors the op runs no kernel: its output and the backward's gradients come from the declared
    shapes and dtypes, and autograd keeps nothing for the backward but the three inputs."""
    saved = []
    with FakeTensorMode():
        value, locations, weights = _inputs(torch.bfloat16, q=40, heads=8, d=32, points=4)
        leaves = [value.requires_grad_(), locations.requires_grad_(), weights.requires_grad_()]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = torch.ops.memfit.ms_deform_attn(value, FLAT, locations, weights)
        out.sum().backward()
    assert out.shape == (1, 40, 256) and out.dtype == torch.bfloat16
    assert [t.shape for t in saved] == [t.shape for t in leaves]
    assert [(t.grad.shape, t.grad.dtype) for t in leaves] == [(t.shape, t.dtype) for t in leaves]


def test_a_step_planned_for_cuda_takes_the_kernel_path():
    """The planner's fake CPU step for a GPU (``measured_for('cuda')``) runs the op the GPU will run, so its
    memory comes from the op's declared outputs; a CPU step runs grid_sample. ``impl`` pins either."""
    layer = MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=3, num_points=2)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    def ops_of_a_call() -> set[str]:
        seen.clear()
        with Ops():
            layer(torch.randn(1, 6, 16), torch.randn(1, 28, 16), None, None, torch.rand(1, 6, 3, 2), list(SHAPES))
        return set(seen)

    seen = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert "grid_sampler_2d" in ops_of_a_call() and "ms_deform_attn" not in seen
        with measured_for("cuda"):
            assert "ms_deform_attn" in ops_of_a_call() and "grid_sampler_2d" not in seen
            layer.impl = "pytorch"
            assert "grid_sampler_2d" in ops_of_a_call()


def test_an_unknown_implementation_is_a_config_error():
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match="impl='cuda' is not a deformable attention implementation"):
        MultiScaleDeformableAttention(impl="cuda")


def test_the_planner_measures_for_the_gpu_and_the_kernel_holds_less():
    """``measure_step(cuda=True)`` (the planner's step for a GPU) runs the model inside ``measured_for('cuda')``,
    where DINO's layers pick the kernel; on fake tensors the kernel path's forward and backward hold the inputs,
    the output and the declared gradients only: less than the grid_sample path, which copies the value to fp32
    and samples level by level (DINO's 32 channels a head, 4 levels, 4 points)."""
    from memfit.measure import MemoryTracker
    from memfit.model import BaseModel
    from memfit.planner.fake import measure_step

    seen = []

    class Probe(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, inputs, data_samples=None, mode="tensor"):
            seen.append(device_type_of(inputs))
            return {"loss": self.fc(inputs).sum()}

    cfg = dict(model=dict(type=Probe), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)))
    for cuda in (True, False):
        measure_step(cfg, full=False, batch=dict(inputs=torch.randn(2, 4)), cuda=cuda)
    assert seen == ["cuda", "cpu"]

    shapes = [(32, 32), (16, 16), (8, 8), (4, 4)]
    peaks = {}
    for impl in ("triton", "pytorch"):
        with FakeTensorMode():
            g = torch.Generator().manual_seed(0)
            leaves = [torch.randn(2, 1360, 2, 32, generator=g).bfloat16().requires_grad_(),
                      torch.rand(2, 768, 2, 4, 4, 2, generator=g).requires_grad_(),
                      torch.rand(2, 768, 2, 4, 4, generator=g).requires_grad_()]
            with MemoryTracker() as tracker:
                multi_scale_deformable_attn(*leaves[:1], shapes, *leaves[1:], impl=impl).sum().backward()
        peaks[impl] = tracker.peak_bytes
    assert peaks["triton"] < 0.35 * peaks["pytorch"], peaks  # measured 2.57 MB against 9.82 MB
