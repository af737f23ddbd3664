"""benchmarks/cuda_temporaries.py's reading of an allocator trace recorded with C++ stacks (the recording needs a
GPU; the reading is checked here on a trace shaped as torch writes it)."""

from __future__ import annotations


def _frames(*names: str) -> list[dict]:
    return [{"name": n, "filename": "", "line": 0} for n in names]


def test_allocations_are_named_by_the_operator_that_made_them(bench_script):
    ct = bench_script("cuda_temporaries")
    softmax = _frames("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
                      "at::detail::empty_generic(...)", "at::native::softmax_backward_cuda_out(...)",
                      "at::_ops::_softmax_backward_data::call(...)",
                      "torch::autograd::generated::SoftmaxBackward0::apply")
    sort = _frames("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
                   "at::native::(anonymous namespace)::index_put_with_sort_kernel(...)")
    node = _frames("c10::cuda::CUDACachingAllocator::malloc", "torch::autograd::generated::AddBackward0::apply(...)")
    trace = [{"action": "alloc", "size": 19668992, "frames": softmax},
             {"action": "alloc", "size": 19208, "frames": sort},
             {"action": "free_requested", "size": 19208, "frames": sort},
             {"action": "alloc", "size": 19668992, "frames": softmax}, {"action": "alloc", "size": 512, "frames": node},
             {"action": "alloc", "size": 512, "frames": _frames("std::function", "??")}]
    assert ct.operator_of(softmax) == "at::native::softmax_backward_cuda_out"
    assert ct.operator_of(sort) == "at::native::(anonymous namespace)::index_put_with_sort_kernel"
    assert ct.operator_of(node) == "torch::autograd::generated::AddBackward0::apply"
    assert ct.operator_of([]) == "?"
    assert ct.group(trace) == [
        {"size": 19668992, "operator": "at::native::softmax_backward_cuda_out", "count": 2},
        {"size": 19208, "operator": "at::native::(anonymous namespace)::index_put_with_sort_kernel", "count": 1},
        {"size": 512, "operator": "?", "count": 1},
        {"size": 512, "operator": "torch::autograd::generated::AddBackward0::apply", "count": 1}]
