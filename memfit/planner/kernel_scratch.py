"""Scratch memory CUDA kernels take from the caching allocator while they run, which a fake CPU step does not: the
planner adds it to a CUDA target's step (:class:`memfit.measure.live_storages.LiveStorages`'s ``scratch``),
allocated after the operator's outputs and freed when the operator returns.

Operators so far: ``torch.roll`` over several dims (:func:`roll_scratch`), softmax's backward
(:func:`softmax_backward_scratch`), fused attention's backward (:func:`attention_backward_scratch`), layer and group
norms forward and backward (:func:`norm_scratch`), and the largest family in vision training, ATen's sums and means
(``aten/src/ATen/native/cuda/Reduce.cuh``). When a reduction's few outputs each sum many inputs (a bias gradient: a
linear layer's output gradient summed over batch and tokens), the kernel splits every output's inputs over several
thread blocks and stages their partial sums in a global buffer of fp32 values (``ReduceConfig::global_memory_size``)
plus a semaphore per output block. ViT-S/16 at batch 32: 74 MiB for each MLP's first bias gradient, freed at once
but counted in ``max_memory_allocated``.

Our own port because torch exposes no way to ask a CUDA kernel's launch configuration without a GPU: the arithmetic
of ``setReduceConfig`` and of TensorIterator's dimension order, for the target's SMs and threads per SM
(:attr:`memfit.planner.devices.Device.sms`), which cap the split where the batch is large (ViT-L at batch 64: 66
blocks per output on an H100, 31 on an RTX 3090). Checked against the buffers in the H100 allocator traces
(tests/planner/test_cuda_traces.py); other GPUs follow the same code with their own counts.
"""

from __future__ import annotations

from typing import Any

import torch

_MAX_THREADS = 512  # mnt_wrapper<scalar_t>::MAX_NUM_THREADS (256 for complex double only)
_WARP = 32
H100_SMS = (132, 2048)  # (streaming multiprocessors, resident threads per SM)
_MIN_VALUES, _MAX_VALUES = 16, 256  # min_values_per_thread, max_values_per_thread
_INPUT_VEC = 4  # ReduceConfig::input_vec_size

_aten = torch.ops.aten
# Sums and means over dims (args: input, dim, ...) and over every element (args: input): Reduce.cuh's
# gpu_reduce_kernel, accumulating in fp32 (double for double inputs). Other reductions (amax, norms) use it
# too, with other accumulators; the traces show none of them in a training step.
_OVER_DIMS = frozenset({_aten.sum.dim_IntList, _aten.mean.dim})
_OVER_ALL = frozenset({_aten.sum.default, _aten.mean.default})
_ROLL = _aten.roll.default
_SOFTMAX_BACKWARD = _aten._softmax_backward_data.default
# What scaled_dot_product_attention's backward dispatches on a fake CPU step (absent from builds without it).
_SDPA_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_SDPA_BACKWARD = _SDPA_BACKWARD.default if _SDPA_BACKWARD is not None else None
_KEY_BLOCK = 64  # the memory-efficient backward's keys per block (kBlockSizeJ): more keys, and dQ accumulates
_NORMS = frozenset({_aten.native_layer_norm.default, _aten.native_layer_norm_backward.default,
                    _aten.native_group_norm.default, _aten.native_group_norm_backward.default})


def roll_scratch(args: tuple, kwargs: dict | None) -> tuple[int, ...]:
    """``torch.roll`` over several dims: ATen's ``roll_common`` rolls the first dim into a new tensor and the rest
    of it recursively, so each dim but the last leaves a tensor of the input's size until the operator returns (a
    shifted Swin block rolls over two dims twice: one more block of its activation each time; the fake step's
    decomposition makes none). Its blocks, as the reductions' are, come after the output here."""
    x = args[0]
    dims = args[2] if len(args) > 2 else (kwargs or {}).get("dims", ())
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not isinstance(x, torch.Tensor) or len(dims) < 2 or x.numel() == 0:
        return ()
    return (x.numel() * x.element_size(),) * (len(dims) - 1)


def softmax_backward_scratch(args: tuple, kwargs: dict | None) -> tuple[int, ...]:
    """Softmax's backward on CUDA multiplies the gradient by the output into a new tensor before its kernel runs
    (``Tensor tmp = grad * output``, ``softmax_backward_cuda_out`` in SoftMax.cu), held until it returns: one block
    of the attention's size more in each of a Swin block's backward (DINO Swin-L's H100 trace: 180 blocks of 132.9 MiB
    in its third stage where the fake step had 162). Log-softmax's backward takes none."""
    grad, output = args[0], args[1]
    if not isinstance(grad, torch.Tensor) or not isinstance(output, torch.Tensor) or grad.numel() == 0:
        return ()
    return (grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize,)


def attention_backward_scratch(args: tuple, kwargs: dict | None) -> tuple[int, ...]:
    """``scaled_dot_product_attention``'s backward in fp16/bf16 on CUDA runs the memory-efficient kernel
    (``_efficient_attention_backward``), which accumulates dQ in fp32 beside each row's softmax delta when the keys
    span more than one block: a byte workspace of ``batch x heads x queries x (head dim + 1)`` floats and 256 bytes,
    after its outputs (ViT-L/16 at batch 64 in the H100 trace: 52,449,536 bytes in each of the 24 blocks' backward;
    ViT-S/16 at batch 32: 9,834,496 in each of 12). Fewer keys than a block (a Swin window's 49) take none; fp32
    inputs, which the traces do not show, none here."""
    query, key = args[1], args[2]
    if not isinstance(query, torch.Tensor) or query.dtype not in (torch.float16, torch.bfloat16) or query.dim() != 4:
        return ()
    if key.shape[-2] <= _KEY_BLOCK:
        return ()
    batch, heads, queries, dim = query.shape
    return (batch * heads * queries * (dim + 1) * 4 + 256,)


def norm_scratch(func: Any, args: tuple, sms: tuple[int, int] = H100_SMS) -> tuple[int, ...]:
    """Layer and group norms on CUDA take contiguous copies of their tensor arguments (``expect_contiguous``,
    ``.contiguous()``: a Swin stage's layer norm over a permuted patch embedding, DINO's neck's group norms whose
    output gradient is a transposed view: blocks of the input's size in the H100 trace, 98.4 and 131.2 MiB). A layer
    norm's backward over many rows of few features (more than 65,536 rows, fewer than half the SMs' warps of
    features) sums the weight's and bias's gradients in two passes: per-block partial sums of
    ``min(32768 / ceil(N / 32), ceil(M / 32)) x N`` values each, then ``.sum(0)`` over them, a reduction with its
    own staging buffer (``LaunchGammaBetaBackwardCUDAKernel`` in layer_norm_kernel.cu; DINO's encoder at two
    1333x800 images: 4 + 4 MiB of partial sums and an 8 MiB staging buffer in each of its 26 layer norms'
    backward)."""
    copies = tuple(t.numel() * t.element_size() for t in args
                   if isinstance(t, torch.Tensor) and t.numel() and not t.is_contiguous())
    if func is not _aten.native_layer_norm_backward.default:
        return NormBlocks.of(copies, 0, 0, 0, 0, sms)
    x, shape, mask = args[1], args[2], args[7] if len(args) > 7 else (True, True, True)
    n = 1
    for d in shape:
        n *= d
    params = [p for p, wanted in zip(args[5:7], mask[1:]) if isinstance(p, torch.Tensor) and wanted]
    if not params:
        return NormBlocks.of(copies, 0, 0, 0, 0, sms)
    return NormBlocks.of(copies, x.numel() // max(n, 1), n, params[0].element_size(), len(params), sms)


def _two_pass(rows: int, features: int, itemsize: int, params: int, sms: tuple[int, int]) -> tuple[int, ...]:
    """A layer norm backward's weight and bias gradients over ``rows`` of ``features`` (:func:`norm_scratch`): its
    partial sums and their reduction's staging buffer, or none where it sums them in one pass."""
    if not params or rows <= 64 * 1024 or features // _WARP >= sms[0] // 2:
        return ()
    blocks = min(32768 // -(-features // _WARP), -(-rows // _WARP))
    acc_size = 8 if itemsize == 8 else 4
    return (blocks * features * itemsize,) * params + \
        reduce_scratch((blocks, features), (features, 1), 0, itemsize, (0,), acc_size, sms)


def cuda_scratch(func: Any, args: tuple, kwargs: dict | None, out: Any, sms: tuple[int, int] = H100_SMS
                 ) -> tuple[int, ...]:
    """Bytes of the scratch blocks ``func`` takes for these arguments on a CUDA device of ``sms`` (SMs, threads
    per SM), in allocation order (freed in reverse when it returns); empty when it takes none."""
    if func is _ROLL:
        return roll_scratch(args, kwargs)
    if func is _SOFTMAX_BACKWARD:
        return softmax_backward_scratch(args, kwargs)
    if func is _SDPA_BACKWARD:
        return attention_backward_scratch(args, kwargs)
    if func in _NORMS:
        return norm_scratch(func, args, sms)
    if func in _OVER_DIMS:
        x = args[0]
        dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
    elif func in _OVER_ALL:
        x, dim = args[0], None
    else:
        return ()
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return ()
    dims = _dims(dim, x.dim())
    return Blocks.of(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.element_size(), dims,
                     8 if x.dtype == torch.float64 else 4, sms)


class Blocks(tuple):
    """A reduction's scratch block sizes (:func:`reduce_scratch`), with the arguments that gave them, so that a
    recording can work them out again at another micro-batch (:mod:`memfit.planner.timeline_scale`): ``spec`` is
    ``(cls, what scales with the micro-batch, what does not)``, and ``cls.at`` makes the blocks from the two."""

    spec: tuple | None = None

    @classmethod
    def of(cls, shape: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int, dims: tuple[int, ...],
           acc_size: int, sms: tuple[int, int]) -> Blocks:
        out = cls(reduce_scratch(shape, stride, offset, itemsize, dims, acc_size, sms))
        out.spec = (cls, (*shape, *stride, offset), (len(shape), itemsize, dims, acc_size, sms))
        return out

    @classmethod
    def at(cls, linear: tuple[int, ...], constant: tuple) -> Blocks:
        """The blocks of ``spec``'s two parts (the first at another micro-batch): the input's shape, strides and
        offset; its dimensions, item size, reduced dims, accumulator size and SMs."""
        ndim, *rest = constant
        return cls.of(linear[:ndim], linear[ndim:2 * ndim], linear[-1], *rest)


class NormBlocks(Blocks):
    """A norm's scratch block sizes (:func:`norm_scratch`), ``spec`` as :class:`Blocks`': what scales with the
    micro-batch are the copies' bytes and the rows (the two passes begin past 65,536 rows)."""

    @classmethod
    def of(cls, copies: tuple[int, ...], rows: int, features: int, itemsize: int, params: int,  # type: ignore[override]
           sms: tuple[int, int]) -> NormBlocks:
        out = cls(copies + _two_pass(rows, features, itemsize, params, sms))
        out.spec = (cls, (*copies, rows), (features, itemsize, params, sms))
        return out

    @classmethod
    def at(cls, linear: tuple[int, ...], constant: tuple) -> NormBlocks:
        """The blocks of ``spec``'s two parts (the first at another micro-batch)."""
        return cls.of(linear[:-1], linear[-1], *constant)


def _dims(dim: Any, ndim: int) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def reduce_scratch(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int,
                   dims: tuple[int, ...], acc_size: int = 4, sms: tuple[int, int] = H100_SMS) -> tuple[int, ...]:
    """``(staging buffer, semaphores)`` bytes of a Reduce.cuh reduction of a tensor (``shape``, ``stride``
    and ``offset`` in elements of ``itemsize`` bytes) over ``dims``, accumulating in ``acc_size``-byte values,
    on a GPU of ``sms`` (SMs, threads per SM); empty where its configuration needs no global reduction."""
    red_shape, in_strides, reduced = _iterator(shape, [s * itemsize for s in stride], dims)
    if not red_shape:
        return ()
    numel = 1
    for n in red_shape:
        numel *= n
    num_reduce = sum(reduced)
    num_outputs = numel
    for n, r in zip(red_shape, reduced):
        if r:
            num_outputs //= n
    inputs_per_output = numel // num_outputs
    ndim = len(red_shape)
    on_fastest = num_reduce == ndim or in_strides[0] < in_strides[num_reduce]
    if on_fastest:
        dim0, dim1, fastest = inputs_per_output, num_outputs, in_strides[0]
    else:
        dim0, dim1, fastest = num_outputs, inputs_per_output, in_strides[num_reduce]
    output_vec = 1
    if fastest == itemsize:
        if on_fastest and dim0 > 128 and num_reduce == 1:  # vectorised along the input
            dim0 //= _INPUT_VEC
        elif not on_fastest:  # vectorised along the output
            output_vec = _output_vec_size(offset, red_shape[num_reduce],
                                          [s // itemsize for i, s in enumerate(in_strides) if i != num_reduce])
            dim0 //= output_vec
    max_threads = _MAX_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input = step_output = 1
    block_x_reduce = on_fastest
    if on_fastest:
        step_input *= width
    else:
        step_output *= width
    values = -(-inputs_per_output // step_input)
    block_y_reduce = values >= height * 16 or values >= _MAX_VALUES
    if block_y_reduce:
        step_input *= height
    else:
        step_output *= height
    values = -(-inputs_per_output // step_input)
    grid = -(-(num_outputs // output_vec) // step_output)
    target = sms[0] * (sms[1] // threads)
    if not (block_y_reduce and values >= _MAX_VALUES and grid <= target):
        return ()
    ctas = max(min(-(-target // grid), -(-values // _MIN_VALUES)), -(-values // _MAX_VALUES))
    if ctas <= 1:
        return ()
    staging = acc_size * num_outputs * ctas * (1 if block_x_reduce else width * output_vec)
    return staging, 4 * grid


def _iterator(shape: tuple[int, ...], strides: list[int], dims: tuple[int, ...]
              ) -> tuple[list[int], list[int], list[bool]]:
    """TensorIterator's view of a reduction (``reorder_dimensions`` then ``coalesce_dimensions``): the shape,
    the input's byte strides and which dims are reduced, fastest first; reduced dims lead."""
    red = set(dims)
    out_strides, acc = [0] * len(shape), 1  # the output: contiguous over the kept dims, 0 over the reduced
    for d in reversed(range(len(shape))):
        if d not in red:
            out_strides[d], acc = acc, acc * shape[d]
    perm = list(range(len(shape)))[::-1]

    def should_swap(d0: int, d1: int) -> int:  # TensorIterator's, output first (its stride-0 dims lead)
        if (out_strides[d0] == 0) != (out_strides[d1] == 0):
            return 1 if out_strides[d1] == 0 else -1
        for st in (out_strides, strides):
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, len(perm)):  # insertion sort with ambiguous comparisons, as TensorIterator does
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    sh = [shape[d] for d in perm]
    ops = [[out_strides[d] for d in perm], [strides[d] for d in perm]]
    if not sh:
        return [], [], []
    prev = 0
    for d in range(1, len(sh)):
        if sh[prev] == 1 or sh[d] == 1 or all(sh[prev] * st[prev] == st[d] for st in ops):
            if sh[prev] == 1:
                for st in ops:
                    st[prev] = st[d]
            sh[prev] *= sh[d]
        else:
            prev += 1
            if prev != d:
                for st in ops:
                    st[prev] = st[d]
                sh[prev] = sh[d]
    n = prev + 1
    return sh[:n], ops[1][:n], [s == 0 for s in ops[0][:n]]


def _output_vec_size(offset: int, outputs_fastest: int, strides: list[int]) -> int:
    vec = 4
    for n in (offset, outputs_fastest, *strides):
        while n % vec:
            vec //= 2
    return vec


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))
