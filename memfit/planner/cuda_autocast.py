"""CUDA autocast's op lists on CPU tensors: a fake CPU step casts activations as a CUDA step would.

CPU and CUDA autocast cast different ops: CUDA runs ``layer_norm``, ``group_norm``, ``softmax``,
``log_softmax``, ``sum``, ``exp``, ``pow``, the upsampling ops ... in fp32 where CPU autocast leaves
them in the input's dtype, lowers ``einsum``, ``mv``, ``addmv`` and the RNN cells where CPU does not,
and leaves pooling and padding alone where CPU casts them to fp32. :func:`cuda_autocast_on_cpu`
makes CPU autocast follow CUDA's policy::

    with cuda_autocast_on_cpu():            # around the whole fake step
        ...                                 # torch.autocast("cpu", dtype=...) inside, as AmpOptimWrapper does

Mechanism: autocast is a dispatcher key. While the context is open, Python kernels are registered
at ``AutocastCPU`` (``torch.library``) for every op whose CUDA policy differs from CPU's; each is
CUDA's ``WrapFunction_`` for that policy (``autocast_mode.h``): cast the floating tensor arguments
(lower precision: the CPU autocast dtype; fp32; promote: the widest), or set an unset ``dtype`` to
fp32, then run the op with autocast excluded. An op CUDA does not register runs on below autocast
(a fallthrough), so the ops a composite calls are autocast as on CUDA. Ops where both lists agree
keep CPU's C++ kernel (and its weight-cast cache). The kernels run only while CPU autocast is on and
only for the listed ops: nothing changes outside autocast, other ops pay nothing. The registrations
are process-wide while the context is open, and removed when the outermost one exits.

Not emulated: CPU's fp32 casts of linear algebra, FFT and quantile ops (:data:`KEPT_CPU_FP32`:
CUDA leaves them alone, but most have no bf16 kernels on either device), ops only one device has
(``cudnn_*``, ``_cudnn_rnn``; CPU's ``mkldnn_rnn_layer`` stays lowered), autograd Functions with
``torch.amp.custom_fwd(device_type="cuda", cast_inputs=...)`` and code testing
``torch.is_autocast_enabled("cuda")`` (CUDA autocast is off on a CPU), and CUDA's fp16 ``softmax``
reading half input directly (with ``dtype=float32`` a CPU makes a transient fp32 copy).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

# --- The lists --------------------------------------------------------------------------------------
# CUDA: torch 2.14.1 (git 5c4886908584029761b579af026dcfb627c84070) as installed,
# torch/include/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE, which
# aten/src/ATen/autocast_mode.cpp registers for AutocastCUDA with cudnn_convolution(_transpose),
# binary_cross_entropy (banned) and linalg_matrix_sqrth (fp32: read from the installed dispatcher on
# fake CUDA tensors; that line is not in the public source read). CPU: autocast_mode.cpp's
# TORCH_LIBRARY_IMPL(aten, AutocastCPU) at pytorch/pytorch@008ec6b1840c94ff6d0f685bc10fbf585167c673,
# less qr and index_copy.dimname, which 2.14.1 no longer registers. Names are "op" (default overload)
# or "op.overload"; tests check both sets against the installed dispatcher's registrations.
_CUDA_LOWER = """
_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
"""
_CUDA_FP32 = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa linalg_matrix_sqrth
"""
_CUDA_FP32_SET_OPT_DTYPE = """
prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
linalg_matrix_norm.str_ord sum sum.dim_IntList
"""
# fp32_append_dtype: the overload without a dtype -> the overload CUDA redispatches to with dtype=fp32.
CUDA_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_CUDA_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
# CUDA-only ops: registered for AutocastCUDA (_cudnn_rnn in cudnn/AutocastRNN.cpp), never run on a CPU.
CUDA_ONLY = frozenset({"cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn"})

_CPU_LOWER = """
conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm
_addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention _native_multi_head_attention
"""
_CPU_FP32 = """
avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile quantile.scalar nanquantile
nanquantile.scalar stft stft.center cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace
view_as_complex cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d
max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss
smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss binary_cross_entropy_with_logits
fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor
linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky
linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv
linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info svd triangular_solve
fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr
linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex linalg_matrix_sqrth
"""
_CPU_PROMOTE = "stack cat index_copy"


def _policies(**lists: str) -> dict[str, str]:
    return {op: policy for policy, names in lists.items() for op in names.split()}


CUDA_POLICIES: dict[str, str] = _policies(
    lower_precision_fp=_CUDA_LOWER, fp32=_CUDA_FP32, fp32_set_opt_dtype=_CUDA_FP32_SET_OPT_DTYPE,
    fp32_append_dtype=" ".join(CUDA_APPEND_DTYPE), promote=_CUDA_PROMOTE, banned="binary_cross_entropy")
CPU_POLICIES: dict[str, str] = _policies(lower_precision_fp=_CPU_LOWER, fp32=_CPU_FP32, promote=_CPU_PROMOTE)

# CPU casts these to fp32 and CUDA leaves them alone, but neither has bf16 kernels for them (cuFFT takes
# fp16 at powers of two): they keep CPU's fp32 so that a plan runs. CPU's mkldnn_rnn_layer stands in for
# CUDA's _cudnn_rnn; _native_multi_head_attention is MultiheadAttention's inference-only fast path.
KEPT_CPU_FP32 = frozenset(
    op for op, policy in CPU_POLICIES.items()
    if policy == "fp32" and op not in CUDA_POLICIES and op.startswith((
        "fft_", "stft", "linalg_", "cholesky", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "geqrf",
        "_lu_with_info", "svd", "triangular_solve", "quantile", "nanquantile", "polar", "view_as_complex",
        "fake_quantize", "ctc_loss"))
) | {"mkldnn_rnn_layer", "_native_multi_head_attention"}


def emulated_policies() -> dict[str, str | None]:
    """The ops whose CPU kernel is replaced while emulating, with the CUDA policy each gets
    (None: CUDA registers none, so CPU's cast is dropped and the op runs in its inputs' dtypes)."""
    out: dict[str, str | None] = {}
    for op in sorted(CUDA_POLICIES.keys() | CPU_POLICIES.keys()):
        cuda, cpu = CUDA_POLICIES.get(op), CPU_POLICIES.get(op)
        if cuda != cpu and op not in KEPT_CPU_FP32 and op not in CUDA_ONLY:
            out[op] = cuda
    return out


# --- Kernels: CUDA's WrapFunction_ per policy (autocast_mode.h) ------------------------------------------
_AUTOCAST_CPU = DispatchKeySet(DispatchKey.AutocastCPU)
_BELOW_AUTOCAST = torch._C._dispatch_keyset_full_after(DispatchKey.AutocastCPU)
_F32, _F64 = torch.float32, torch.float64
_BANNED = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
           "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
           "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
           "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
           "safe to autocast. (CUDA autocast's message, emulated on CPU by memfit)")

# CUDA's cast cache (cached_cast): lower-precision casts of fp32 leaf tensors that require grad (weights).
# CUDA keeps them until the outermost autocast exits; this keeps a weak reference, reused while anything
# (autograd's saved tensors) holds the cast. Keyed by id, checked against a weak reference to the source.
_cast_cache: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not _F64


def _cast_one(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype is dtype or t.dtype is _F64:
        return t
    if dtype is not _F32 and t.dtype is _F32 and t.requires_grad and t.is_leaf and not t._is_view():
        hit = _cast_cache.get(id(t))
        if hit is not None and hit[0]() is t:
            cast = hit[1]()
            if cast is not None and cast.dtype is dtype:
                return cast
        cast = t.to(dtype)
        _cast_cache[id(t)] = (weakref.ref(t), weakref.ref(cast))
        return cast
    return t.to(dtype)


def _cast(arg: Any, dtype: torch.dtype) -> Any:
    if isinstance(arg, torch.Tensor):
        return _cast_one(arg, dtype)
    if isinstance(arg, (list, tuple)) and any(isinstance(a, torch.Tensor) for a in arg):
        return type(arg)(_cast_one(a, dtype) if isinstance(a, torch.Tensor) else a for a in arg)
    return arg


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _promote_type(args: tuple, kwargs: dict) -> torch.dtype:
    """at::autocast::promote_type: fp32 if any eligible argument is fp32, else the autocast dtype."""
    low = current = torch.get_autocast_dtype("cpu")
    for t in _tensors(args, kwargs):
        if not _eligible(t):
            continue
        if current is _F32 or t.dtype is _F32:
            current = _F32
        elif t.dtype is not low:
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _cast_kernel(op: Any, policy: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == "fp32":
                dtype = _F32
            elif policy == "promote":
                dtype = _promote_type(args, kwargs)
            else:
                dtype = torch.get_autocast_dtype("cpu")
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return kernel


def _set_opt_dtype_kernel(op: Any) -> Callable[..., Any]:
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if _eligible(args[0]):
                if index < len(args):
                    if args[index] is None:
                        args = (*args[:index], _F32, *args[index + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": _F32}
            return op(*args, **kwargs)
    return kernel


def _append_dtype_kernel(op: Any, target: Any) -> Callable[..., Any]:
    arguments = op._schema.arguments

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            dtype = _F32 if _eligible(args[0]) else args[0].dtype
            full = list(args) + [kwargs.get(a.name, a.default_value) for a in arguments[len(args):]]
            return target(*full, dtype=dtype)
    return kernel


def _banned_kernel(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(_BANNED)


def _fallthrough_kernel(op: Any) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return op.redispatch(keyset & _BELOW_AUTOCAST, *args, **kwargs)
    return kernel


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _kernels() -> list[tuple[str, Callable[..., Any], bool]]:
    """(op name, kernel, with_keyset) for every op of :func:`emulated_policies` this torch has."""
    out = []
    for name, policy in emulated_policies().items():
        try:
            op = _overload(name)
        except AttributeError:
            continue  # an op this torch build does not have
        if policy is None:
            out.append((name, _fallthrough_kernel(op), True))
        elif policy == "fp32_set_opt_dtype":
            out.append((name, _set_opt_dtype_kernel(op), False))
        elif policy == "fp32_append_dtype":
            out.append((name, _append_dtype_kernel(op, _overload(CUDA_APPEND_DTYPE[name])), False))
        elif policy == "banned":
            out.append((name, _banned_kernel, False))
        else:
            out.append((name, _cast_kernel(op, policy), False))
    return out


# --- The context ------------------------------------------------------------------------------------------
_lock = threading.Lock()
_state: dict[str, Any] = {"depth": 0, "library": None, "kernels": None}


class _CudaAutocastOnCpu(AbstractContextManager):
    def __enter__(self) -> None:
        with _lock:
            if _state["depth"] == 0:
                if _state["kernels"] is None:
                    _state["kernels"] = _kernels()
                library = torch.library.Library("aten", "IMPL")
                try:
                    for name, kernel, with_keyset in _state["kernels"]:
                        library.impl(name, kernel, "AutocastCPU", with_keyset=with_keyset)
                except BaseException:
                    library._destroy()
                    raise
                _state["library"] = library
            _state["depth"] += 1

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                _state["library"]._destroy()
                _state["library"] = None
                _cast_cache.clear()


def cuda_autocast_on_cpu(enabled: bool = True) -> AbstractContextManager[None]:
    """While open, CPU autocast casts ops as CUDA autocast would (for the CPU autocast dtype, bf16 or
    fp16); outside an active CPU autocast nothing changes. ``enabled=False``: a no-op context, so a
    caller writes one line, ``with cuda_autocast_on_cpu(enabled=target_is_cuda):``. Re-entrant."""
    return _CudaAutocastOnCpu() if enabled else nullcontext()
