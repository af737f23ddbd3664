"""On a GPU: what the first call of each kernel family leaves allocated beyond its output (cuBLAS/cuBLASLt
workspaces, cuDNN's), which the planner counts as the CUDA workspace of a step.

    python benchmarks/gpu_calibration.py workspaces
"""

from __future__ import annotations


def workspaces() -> dict:
    """Bytes the first call of each kernel family leaves allocated beyond its output (cuBLAS/cuBLASLt
    workspaces, cuDNN's), each in a fresh allocator state of this process, in call order."""
    import torch
    import torch.nn.functional as F

    def x(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)

    calls = {
        "mm fp32": lambda: x(512, 512) @ x(512, 512),
        "linear+bias fp32": lambda: F.linear(x(512, 512), x(512, 512), x(512)),
        "mm bf16": lambda: x(512, 512, dtype=torch.bfloat16) @ x(512, 512, dtype=torch.bfloat16),
        "linear+bias bf16": lambda: F.linear(*(x(*s, dtype=torch.bfloat16) for s in ((512, 512), (512, 512), (512,)))),
        "linear fp16 backward": lambda: F.linear(x(512, 512, dtype=torch.half, grad=True),
                                                 x(512, 512, dtype=torch.half, grad=True)).sum().backward(),
        "bmm bf16": lambda: torch.bmm(x(8, 256, 64, dtype=torch.bfloat16), x(8, 64, 256, dtype=torch.bfloat16)),
        "sdpa bf16 backward": lambda: F.scaled_dot_product_attention(
            *(x(4, 8, 256, 64, dtype=torch.bfloat16, grad=True) for _ in range(3))).sum().backward(),
        "conv fp32 backward": lambda: F.conv2d(x(8, 64, 56, 56, grad=True), x(64, 64, 3, 3, grad=True),
                                               padding=1).sum().backward(),
        "conv bf16 backward": lambda: F.conv2d(x(8, 64, 56, 56, dtype=torch.bfloat16, grad=True),
                                               x(64, 64, 3, 3, dtype=torch.bfloat16, grad=True),
                                               padding=1).sum().backward(),
    }
    out = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        kept = result.numel() * result.element_size() if isinstance(result, torch.Tensor) else 0
        out[name] = torch.cuda.memory_allocated() - before - kept
        del result
    return out
