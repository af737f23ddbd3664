"""``memfit bench --calibrate``'s optimizer benchmarks: AdamW's step on the device (foreach and fused) and on the
host CPU (an offloaded optimizer's), over ViT-B's parameter tensors."""

from __future__ import annotations

import torch

from memfit.planner.calibration_timing import Bench, DispatchCounter, rounded
from memfit.planner.cost import ModelState, optimizer_pass_seconds
from memfit.planner.devices import Device

# ViT-B/16's parameter tensors (numel), 152 of them, 86.6M: patch embedding, class token, position embedding,
# 12 blocks of (norm, qkv, proj, norm, fc1, fc2), the final norm and the head.
VIT_B = ([768 * 3 * 16 * 16, 768, 768, 197 * 768]
         + 12 * [768, 768, 2304 * 768, 2304, 768 * 768, 768, 768, 768, 3072 * 768, 3072, 768 * 3072, 768]
         + [768, 768, 1000 * 768, 1000])


def _with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params``, each given a random gradient of its own shape."""
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def optimizer(b: Bench, ref: Device) -> dict[str, float]:
    """AdamW's step, foreach and fused, over ViT-B's tensors at full and 1/16 size: seconds = passes x one pass
    (:func:`memfit.planner.cost.optimizer_pass_seconds`) + operators (as the fake step counts them) x op_us."""
    scales = (1 / 1024, 1 / 16384) if b.quick else (1.0, 1 / 16)
    out: dict[str, float] = {}
    for variant in ("foreach", "fused"):
        points = []
        for scale in scales:
            params = _with_grads([b.randn(max(int(n * scale), 1), grad=True) for n in VIT_B])
            opt = torch.optim.AdamW(params, lr=1e-4, **{variant: True})
            seconds = b.seconds(opt.step)
            nbytes = sum(p.numel() for p in params) * 4
            points.append((optimizer_pass_seconds(ModelState(nbytes, nbytes, 2 * nbytes), ref), seconds))
        # the fake step's count: CPU, foreach forced
        cpu = _with_grads([torch.randn(1, requires_grad=True) for _ in VIT_B])
        opt = torch.optim.AdamW(cpu, lr=1e-4, **{variant: True})
        opt.step()
        with DispatchCounter() as counter:
            opt.step()
        (big_pass, big), (small_pass, small) = points
        passes = (big - small) / (big_pass - small_pass)
        if passes <= 0:  # noise at tiny sizes: all of it as passes
            passes = big / big_pass
        fixed = max(big - passes * big_pass, 0.0)
        out.update({f"{variant}_seconds": rounded(big), f"{variant}_passes": rounded(passes),
                    f"{variant}_op_us": rounded(fixed / counter.ops * 1e6), f"{variant}_ops": counter.ops,
                    f"{variant}_tensor_us": rounded(fixed / len(VIT_B) * 1e6)})
    return out


def host_step(b: Bench) -> float:
    """GB/s of AdamW's step on the host CPU (an offloaded optimizer's: torch's default there) over ViT-B's tensors,
    counted as :func:`memfit.planner.cost.step_time` counts an offloaded step: parameters, gradients and twice
    the state."""
    scale = 1 / 1024 if b.quick else 1.0
    params = _with_grads([torch.randn(max(int(n * scale), 1), requires_grad=True) for n in VIT_B])
    opt = torch.optim.AdamW(params, lr=1e-4)
    seconds = b.seconds(opt.step, repeats=1 if b.quick else 4)  # its warm-up step creates the state
    nbytes = sum(p.numel() for p in params) * 4
    return rounded((nbytes + nbytes + 2 * 2 * nbytes) / seconds / 1e9)
