"""Rank script: several optimizers (a GAN-like model with a custom train_step) under DDPStrategy, one DDP
per submodule, against the same training in one process on the whole global batch.

Each variant trains STEPS iterations on this rank's half of a fixed global batch and records the final
parameters, the state-dict keys, the optimizer-state keys and, after the first iteration (inside the
discriminator's accumulation window), whether each submodule's gradients are equal on both ranks.
Rank 0 also runs the reference: the same model and optimizers built without a strategy, on the whole
batch, in its own process (no collective is involved).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from memfit import dist
from memfit.connector import setup
from memfit.model import BaseModel
from memfit.optim import build_optim_wrapper
from memfit.strategies import DDPStrategy, strategy_from_model_wrapper
from memfit.testing import write_result

GLOBAL_BATCH, STEPS, DIM = 8, 4, 6
OPTIM = dict(generator=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
             discriminator=dict(optimizer=dict(type="SGD", lr=0.05, momentum=0.9), accumulative_counts=2))


class GAN(BaseModel):
    """A generator and a discriminator, each stepped by its own optimizer in a custom train_step (mmagic's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Linear(DIM, DIM)
        self.discriminator = nn.Linear(DIM, 1)

    def train_step(self, data, optim_wrapper):
        z, real = data
        disc, gen = optim_wrapper["discriminator"], optim_wrapper["generator"]
        with torch.no_grad():
            fake = self.generator(z)
        with disc.optim_context(self.discriminator):
            scores = self.discriminator(torch.cat([real, fake]))
            loss_d = F.softplus(-scores[:len(real)]).mean() + F.softplus(scores[len(real):]).mean()
        disc.update_params(loss_d)
        self.discriminator.requires_grad_(False)  # the generator's step leaves the discriminator's gradients
        with gen.optim_context(self.generator):
            loss_g = F.softplus(-self.discriminator(self.generator(z))).mean()
        gen.update_params(loss_g)
        self.discriminator.requires_grad_(True)
        return dict(loss_d=loss_d.detach(), loss_g=loss_g.detach())


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g) + 1.0


def params(model: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().flatten().tolist() for n, p in sorted(model.named_parameters())}


def equal_on_ranks(tensors: list[torch.Tensor]) -> bool:
    """True when ``tensors`` are the same on every rank."""
    g = torch.cat([t.detach().flatten() for t in tensors])
    gathered = [torch.zeros_like(g) for _ in range(dist.get_world_size())]
    tdist.all_gather(gathered, g)
    return all(torch.equal(gathered[0], t) for t in gathered)


def train(model: nn.Module, wrapper, local: bool) -> list[bool]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if local else (0, 1)
    share = GLOBAL_BATCH // world
    synced = []
    for step in range(STEPS):
        z, real = (t[rank * share:(rank + 1) * share] for t in data(step))
        model.train_step((z, real), wrapper)
        if local and step == 0:
            # Inside the discriminator's window (1 of 2): its gradients stay local; the generator's
            # window closed, so it was reduced and stepped (and its gradients zeroed: compare weights).
            synced = [equal_on_ranks([p.grad for p in model.discriminator.parameters()]),
                      equal_on_ranks(list(model.generator.parameters()))]
    return synced


def run(strategy) -> dict:
    model, wrapper = setup(GAN(), strategy, OPTIM)
    synced = train(model, wrapper, local=True)
    return {"params": params(model), "synced_after_first": synced,
            "state_keys": sorted(strategy.model_state_dict(model)),
            "optim_keys": sorted(strategy.optim_state_dict(model, wrapper)),
            "separate": sorted(strategy.separate_ddps)}


def main() -> None:
    results = {
        "ddp": run(DDPStrategy()),  # several optimizers switch one DDP per submodule on
        "model_wrapper_cfg": run(strategy_from_model_wrapper(dict(type="MMSeparateDistributedDataParallel"))),
    }
    if dist.get_rank() == 0:
        model = GAN()
        wrapper = build_optim_wrapper(model, OPTIM)  # one device, no process group involved
        train(model, wrapper, local=False)
        results["reference"] = {"params": params(model)}
    write_result(results)


if __name__ == "__main__":
    DDPStrategy().setup_env("pytorch")
    main()
