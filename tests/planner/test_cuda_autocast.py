"""cuda_autocast_on_cpu: CPU autocast casting ops as CUDA autocast does.

CUDA's policy: https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float16 and
#cuda-ops-that-can-autocast-to-float32 (layer_norm, group_norm, softmax, log_softmax, sum, exp, pow ...
run in fp32), #cuda-ops-that-promote-to-the-widest-input-type (addcmul, atan2, ...). The oracle test
runs the installed torch's real AutocastCUDA kernels on fake CUDA tensors (no GPU needed for forward).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure import MemoryTracker
from memfit.planner.cuda_autocast import CPU_POLICIES, CUDA_ONLY, CUDA_POLICIES, cuda_autocast_on_cpu

BF16, F32 = torch.bfloat16, torch.float32


@contextlib.contextmanager
def cuda_policy(dtype=BF16, emulate=True):
    with cuda_autocast_on_cpu(emulate), torch.autocast("cpu", dtype=dtype):
        yield


def test_lists_are_the_installed_torch_registrations():
    names = torch._C._dispatch_get_all_op_names()

    def registered(key):
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        return {n[6:] for n in names if n.startswith("aten::") and has(n, key)}

    assert registered("AutocastCPU") == set(CPU_POLICIES)
    assert registered("AutocastCUDA") == set(CUDA_POLICIES) | CUDA_ONLY


def test_fp32_ops():
    x, img = torch.randn(4, 8, dtype=BF16), torch.randn(2, 4, 3, 3, dtype=BF16)
    w, b = torch.randn(8), torch.randn(8)
    with cuda_policy():
        outs = [F.layer_norm(x, (8,), w, b), nn.LayerNorm(8)(x), x.softmax(-1), F.softmax(x, -1), torch.softmax(x, 0),
                F.log_softmax(x, -1), F.group_norm(img, 2), x.exp(), x.sum(), x.sum(1), x ** 2, x.cumsum(0),
                F.interpolate(img, scale_factor=2.0, mode="bilinear"), F.normalize(x)]
        assert F.softmax(x, -1, dtype=BF16).dtype == BF16  # an explicit dtype is kept (fp32_set_opt_dtype)
    assert [o.dtype for o in outs] == [F32] * len(outs)
    with torch.autocast("cpu", dtype=BF16):  # CPU autocast alone leaves them in bf16
        assert F.layer_norm(x, (8,), w, b).dtype == x.softmax(-1).dtype == x.sum().dtype == BF16


def test_lower_precision_and_promote_ops():
    x, w, v = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    img, cw = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with cuda_policy():
        low = [F.linear(x, w), x @ w, F.conv2d(img, cw), F.conv2d(img, cw, padding="same"),
               torch.einsum("ij,jk->ik", x, w), torch.mv(w, v), torch.addmv(v, w, v)]  # mv, addmv: CUDA only
        xb = x.to(BF16)
        mixed = [torch.addcmul(xb, xb, x), torch.atan2(xb, x), torch.cat([xb, x]), torch.stack([xb, x])]
        both_low = torch.addcmul(xb, xb, xb)
    assert [t.dtype for t in low] == [BF16] * len(low)
    assert [t.dtype for t in mixed] == [F32] * len(mixed)
    assert both_low.dtype == BF16


def test_cpu_only_casts_are_dropped():
    """CPU autocast casts these, CUDA autocast does not: _addmm_activation to bf16, padding, 3-d pooling to fp32."""
    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    img, vol = torch.randn(1, 2, 5, 5, dtype=BF16), torch.randn(1, 2, 4, 4, 4, dtype=BF16)

    def run():
        return [torch.ops.aten._addmm_activation(b, x, w).dtype, F.pad(img, (1, 1, 1, 1), mode="reflect").dtype,
                F.max_pool3d(vol, 2).dtype, F.adaptive_avg_pool3d(vol, 1).dtype]

    with torch.autocast("cpu", dtype=BF16):
        assert run() == [BF16, F32, F32, F32]
    with cuda_policy():
        assert run() == [F32, BF16, BF16, BF16]


def test_nothing_changes_outside_autocast():
    x = torch.randn(4, 8, dtype=BF16)
    with cuda_autocast_on_cpu():
        assert F.layer_norm(x, (8,)).dtype == x.softmax(-1).dtype == BF16
        assert F.linear(x.float(), torch.randn(8, 8)).dtype == F32
        with torch.autocast("cpu", dtype=BF16, enabled=False):
            assert F.layer_norm(x, (8,)).dtype == BF16
        with cuda_autocast_on_cpu():  # re-entrant: the inner exit keeps the outer registrations
            pass
        with torch.autocast("cpu", dtype=BF16):
            assert F.layer_norm(x, (8,)).dtype == F32
    with cuda_policy(emulate=False):  # after exit, and with enabled=False: CPU autocast's own lists
        assert F.layer_norm(x, (8,)).dtype == BF16
        assert F.pad(x[None], (1, 1), mode="reflect").dtype == F32


def test_binary_cross_entropy_is_banned_as_on_cuda():
    p = torch.rand(4)
    with cuda_policy(), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def _oracle_cases(device, low):
    x, w, v = (torch.empty(4, 8, device=device, dtype=low), torch.empty(8, 8, device=device),
               torch.empty(8, device=device))
    img = torch.empty(2, 4, 8, 8, device=device, dtype=low)
    vol = torch.empty(1, 2, 4, 4, 4, device=device, dtype=low)
    cw, tgt = torch.empty(4, 4, 3, 3, device=device), torch.zeros(4, dtype=torch.long, device=device)
    c4 = torch.empty(4, device=device)
    return [lambda: F.layer_norm(x, (8,), v, v), lambda: F.group_norm(img, 2), lambda: F.rms_norm(x, (8,)),
            lambda: F.softmax(x, -1), lambda: F.softmax(x, -1, dtype=low), lambda: F.log_softmax(x, -1),
            lambda: x.sum(), lambda: x.sum(1), lambda: x.cumsum(0), lambda: x.prod(), lambda: x.exp(),
            lambda: x ** 2, lambda: x.rsqrt(), lambda: x.logsumexp(1), lambda: F.normalize(x), lambda: x.norm(),
            lambda: torch.norm(x, dim=1), lambda: F.interpolate(img, scale_factor=2.0, mode="bilinear"),
            lambda: F.interpolate(img, scale_factor=2.0), lambda: F.cross_entropy(x, tgt), lambda: F.mse_loss(x, x),
            lambda: F.linear(x, w, v), lambda: x @ w, lambda: F.conv2d(img, cw),
            lambda: F.conv2d(img, cw, padding="same"),
            lambda: torch.einsum("ij,jk->ik", x, w), lambda: torch.mv(w, v), lambda: torch.addmv(v, w, v),
            lambda: torch.addcmul(x, x, w[:4]), lambda: torch.cat([x, w]),
            lambda: F.pad(img, (1, 1, 1, 1), mode="reflect"),
            lambda: F.max_pool3d(vol, 2), lambda: F.avg_pool3d(vol, 2), lambda: F.gelu(x),
            lambda: F.batch_norm(img, None, None, c4, c4, training=True),
            lambda: F.scaled_dot_product_attention(img, img, img), lambda: F.cosine_similarity(x, x),
            lambda: F.grid_sample(img, torch.empty(2, 3, 3, 2, device=device), align_corners=False),
            lambda: torch.trace(w.to(low)), lambda: w.index_put((tgt,), x[0]), lambda: F.softplus(x)]


@pytest.mark.parametrize("low", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_matches_cuda_autocast_kernels_on_fake_cuda_tensors(low):
    """The installed torch's AutocastCUDA kernels run on fake CUDA tensors (forward only, no GPU); the
    emulation on fake CPU tensors must give every output the same dtype, where CPU autocast alone does not."""
    def dtypes(device, context):
        with FakeTensorMode(), context:
            return [case().dtype for case in _oracle_cases(device, low)]

    @contextlib.contextmanager
    def cuda_autocast():
        before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)  # torch.autocast("cuda") turns itself off without a GPU
        torch.set_autocast_dtype("cuda", low)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", before[0])
            torch.set_autocast_dtype("cuda", before[1])

    try:
        cuda = dtypes("cuda", cuda_autocast())
    except (RuntimeError, AssertionError) as e:  # a torch build that cannot make fake CUDA tensors
        pytest.skip(f"fake CUDA tensors: {e}")
    assert dtypes("cpu", cuda_policy(low)) == cuda
    cpu = dtypes("cpu", cuda_policy(low, emulate=False))
    assert sum(a != b for a, b in zip(cpu, cuda)) >= 20  # CPU autocast's lists differ on more than half


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Softmax(-1), nn.Linear(32, 8))


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_model_forward_backward(fake):
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, x = _model(), torch.randn(4, 16)
        seen = []
        for m in model:
            m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        with cuda_policy():
            loss = model(x).float().square().mean()
        loss.backward()
    assert seen == [BF16, F32, F32, BF16]  # linear, LayerNorm (fp32 on CUDA), softmax (fp32), linear
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == F32 for g in grads)
    if not fake:
        assert all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)


def test_activation_memory_follows_the_dtypes():
    """x (bf16, N x D) -> layer_norm -> gelu, bytes alive after forward (saved tensors and the output).
    CPU autocast: layer_norm saves x itself and its mean and rstd (bf16, N each), gelu saves its bf16
    input, the output is bf16: 2 * 2ND + 2 * 2N. CUDA: layer_norm runs in fp32, so it saves an fp32
    copy of x (4ND) and fp32 mean and rstd, and its output, saved by gelu, and gelu's are fp32:
    3 * 4ND + 2 * 4N. The difference, 8ND + 4N, is exactly the dtype change."""
    n, d = 64, 32
    x = torch.randn(n, d, dtype=BF16, requires_grad=True)

    def alive_after_forward(emulate):
        with MemoryTracker() as t:
            with cuda_policy(emulate=emulate):
                out = F.gelu(F.layer_norm(x, (d,)))
            t.reset_peak()
            alive = t.peak_so_far()[1]["activations"]
            out.float().sum().backward()
        return alive, out.dtype, t.peak_bytes

    cpu, cpu_dtype, cpu_peak = alive_after_forward(False)
    cuda, cuda_dtype, cuda_peak = alive_after_forward(True)
    assert (cpu_dtype, cuda_dtype) == (BF16, F32)
    assert cpu == 2 * 2 * n * d + 2 * 2 * n
    assert cuda == 3 * 4 * n * d + 2 * 4 * n
    assert cuda - cpu == 8 * n * d + 4 * n
    assert cuda_peak > cpu_peak


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sources = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.sources.append(args[0])
        return func(*args, **(kwargs or {}))


def test_weight_casts_are_reused_while_alive():
    """CUDA caches the lower-precision cast of an fp32 leaf that requires grad: two einsums with one
    weight (an op CPU autocast does not lower) cast it once while the first cast is saved for backward."""
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
    with cuda_policy(), _Casts() as casts:
        y = torch.einsum("ij,jk->ik", x, w) + torch.einsum("ij,jk->ik", x, w)
    y.float().sum().backward()
    assert sum(s is w for s in casts.sources) == 1
    assert w.grad is not None and w.grad.isfinite().all()
