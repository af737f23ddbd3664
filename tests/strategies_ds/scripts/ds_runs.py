"""Rank script: DeepSpeed resume, export, load_from, the seed's snippet and its failure in miniature.

Usage: ``ds_runs.py COMMAND[:ARG] ...``, run in order in one process (imports are slow):

- ``full:WD`` / ``kill:WD`` / ``resume:WD``: ZeRO-3 with torch autocast (bf16), k=2, 8 iterations,
  a checkpoint every 4. ``kill`` ends the process (``os._exit``, no cleanup) right after the
  iteration-4 checkpoint; ``resume`` continues from ``last_checkpoint`` and exports the final one.
- ``single:WD``: one process: resuming WD's 2-rank checkpoint fails with a clear error; ``load_from``
  of the exported weights lands in the ZeRO-3 shards and in the optimizer's fp32 master copy.
- ``seed``: mmengine_training_big_models.md's FlexibleRunner DeepSpeed snippet (fp16 -> bf16).
- ``equivalence:CASE,...``: ds_equivalence.py's cases (ZeRO 0-3 x precision x offload against one process).
- ``dino``: a hand-written BCE with a 1e-5 epsilon (as detection heads write it) under whole-model
  bf16 and under memfit's autocast with the loss as an fp32 island.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from memfit import dist
from memfit.errors import MemfitError
from memfit.hooks.base import Hook
from memfit.model import BaseModel
from memfit.runner import FlexibleRunner, Runner
from memfit.testing import write_result

OUT = os.environ["MEMFIT_TEST_OUT"]
DIM, N = 8, 64
RESULTS: dict = {}


class Net(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x, y, mode="tensor"):
        out = self.body(x)
        return dict(loss=F.cross_entropy(out.float(), y)) if mode == "loss" else (out, y)


class Record(Hook):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.losses.append(float(dist.all_reduce_mean(outputs["loss"].detach().float())))


class Kill(Hook):
    priority = "LOWEST"  # after the checkpoint hook has written iter_4

    def __init__(self, at: int, record: Record) -> None:
        self.at, self.record = at, record

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 == self.at:
            write_result({"losses": self.record.losses}, "kill")
            dist.barrier()
            os._exit(0)


def dataset() -> list:
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(N, DIM, generator=g), torch.randint(0, 3, (N,), generator=g)
    return [(xs[i], ys[i]) for i in range(N)]


def zero3_runner(work_dir: str, hooks: list, resume: bool | str = False, load_from: str | None = None,
                 max_iters: int = 8, lr: float = 1e-2) -> Runner:
    torch.manual_seed(0)
    return Runner(
        model=Net(), work_dir=work_dir, strategy="deepspeed_stage_3",
        train_dataloader=dict(batch_size=4, dataset=dataset(), sampler=dict(type="DefaultSampler", shuffle=True)),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16", optimizer=dict(type="AdamW", lr=lr),
                           accumulative_counts=2),
        param_scheduler=dict(type="LinearLR", start_factor=0.5, by_epoch=False, begin=0, end=8),
        default_hooks=dict(checkpoint=dict(interval=4, by_epoch=False), logger=dict(interval=100)),
        custom_hooks=hooks, randomness=dict(seed=0), resume=resume, load_from=load_from,
    )


def state_of(runner: Runner) -> dict[str, list]:
    return {k: v.flatten().tolist() for k, v in sorted(runner.strategy.full_state_dict(runner.model).items())}


def cmd_full(wd: str) -> None:
    record = Record()
    runner = zero3_runner(wd, [record])
    runner.train()
    RESULTS["full"] = dict(losses=record.losses, state=state_of(runner), lr=runner.optim_wrapper.get_lr()["lr"][0])


def cmd_kill(wd: str) -> None:
    record = Record()
    zero3_runner(wd, [record, Kill(4, record)]).train()


def cmd_resume(wd: str) -> None:
    from memfit.checkpoint import export_safetensors, read_latest

    record = Record()
    runner = zero3_runner(wd, [record], resume=True)
    runner.train()
    state = state_of(runner)
    exported = {}
    if dist.is_main_process():
        path = export_safetensors(read_latest(wd), os.path.join(OUT, "model.safetensors"))
        from safetensors.torch import load_file

        exported = {k: v.flatten().tolist() for k, v in sorted(load_file(str(path)).items())}
    files = sorted(os.listdir(os.path.join(wd, "iter_8.pth")))
    RESULTS["resume"] = dict(losses=record.losses, state=state, exported=exported, files=files,
                             lr=runner.optim_wrapper.get_lr()["lr"][0], latest=str(read_latest(wd)))


def cmd_single(wd: str) -> None:
    try:
        zero3_runner(os.path.join(OUT, "single_resume"), [], resume=os.path.join(wd, "iter_8.pth")).train()
        error = None
    except MemfitError as exc:
        error = str(exc)
    from safetensors.torch import load_file

    weights = os.path.join(OUT, "model.safetensors")
    # lr=0: a step must leave the loaded weights as they are, which holds only if the optimizer's fp32
    # master copy was refreshed from them (else the step writes the initial weights back).
    runner = zero3_runner(os.path.join(OUT, "single_load"), [], load_from=weights, max_iters=2, lr=0.0)
    runner.train()
    loaded = runner.strategy.full_state_dict(runner.model)
    expected = load_file(weights)
    diff = max(float((loaded[k] - expected[k]).abs().max()) for k in sorted(expected))
    RESULTS["single"] = dict(error=error, load_from_diff=diff, world_size=dist.get_world_size())


# -- the seed's snippet (mmengine_training_big_models.md, DeepSpeed), imports changed ---------------
class MMResNet50(BaseModel):
    def __init__(self):
        super().__init__()
        self.resnet = torchvision.models.resnet50(num_classes=10)

    def forward(self, imgs, labels, mode):
        x = self.resnet(imgs)
        if mode == 'loss':
            return {'loss': F.cross_entropy(x, labels)}
        elif mode == 'predict':
            return x, labels


class ValMetrics(Hook):
    def __init__(self) -> None:
        self.metrics: dict = {}

    def after_val_epoch(self, runner, metrics=None):
        self.metrics = {k: float(v) for k, v in (metrics or {}).items()}


def cmd_seed(_: str = "") -> None:
    from memfit.evaluator import Accuracy

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 32, 32, generator=g), int(i % 10)) for i in range(8)]
    train_dataloader = dict(batch_size=2, dataset=data, sampler=dict(type='DefaultSampler', shuffle=True))
    val_dataloader = dict(batch_size=2, dataset=data, sampler=dict(type='DefaultSampler', shuffle=False))

    # set `type='DeepSpeedStrategy'` and configure other parameters
    strategy = dict(
        type='DeepSpeedStrategy',
        bf16=dict(enabled=True),  # the seed's fp16=dict(...): DeepSpeed has no fp16 mode on CPU
        inputs_to_half=[0],
        zero_optimization=dict(
            stage=3,
            allgather_partitions=True,
            reduce_scatter=True,
            allgather_bucket_size=50000000,
            reduce_bucket_size=50000000,
            overlap_comm=True,
            contiguous_gradients=True,
            cpu_offload=False),
    )

    # set `type='DeepSpeedOptimWrapper'` and configure other parameters
    optim_wrapper = dict(
        type='DeepSpeedOptimWrapper',
        optimizer=dict(type='AdamW', lr=1e-3))

    metrics = ValMetrics()

    # construct FlexibleRunner
    runner = FlexibleRunner(
        custom_hooks=[metrics],
        model=MMResNet50(),
        work_dir=os.path.join(OUT, 'seed'),
        strategy=strategy,
        train_dataloader=train_dataloader,
        optim_wrapper=optim_wrapper,
        param_scheduler=dict(type='LinearLR'),
        train_cfg=dict(by_epoch=True, max_epochs=1, val_interval=1),
        val_dataloader=val_dataloader,
        val_cfg=dict(),
        val_evaluator=dict(type=Accuracy))

    # start training
    runner.train()
    engine = runner.strategy.engine
    RESULTS["seed"] = dict(iters=runner.iter, stage=engine.zero_optimization_stage(),
                           param_dtype=str(next(engine.module.parameters()).dtype),
                           bn_stats_dtype=str(engine.module.resnet.bn1.running_mean.dtype),
                           checkpoint=sorted(os.listdir(os.path.join(OUT, 'seed', 'epoch_1.pth'))),
                           val_metrics=metrics.metrics)


# -- the seed's failure in miniature ----------------------------------------------------------------
class HandBCE(nn.Module):
    """Binary cross-entropy as detection heads often write it: sigmoid, then log with a 1e-5 epsilon."""

    def forward(self, logits, target):
        p = logits.sigmoid()
        return -(target * torch.log(p + 1e-5) + (1 - target) * torch.log(1 - p + 1e-5)).mean()


class Scorer(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(DIM, 1)
        nn.init.zeros_(self.cls.weight)
        nn.init.constant_(self.cls.bias, 8.0)  # confident: sigmoid(8) = 0.99966 rounds to 1.0 in bf16
        self.loss = HandBCE()

    def forward(self, x, y, mode="tensor"):
        logits = self.cls(x).squeeze(-1)
        return dict(loss=self.loss(logits, y.to(logits.dtype)))


def cmd_dino(_: str = "") -> None:
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(32, DIM, generator=g)
    data = [(xs[i], torch.tensor(float(xs[i, 0] > 0))) for i in range(32)]
    out = {}
    for name, strategy, wrapper in (
        ("whole_model_bf16", dict(type="DeepSpeedStrategy", bf16=dict(enabled=True), inputs_to_half=[0],
                                  zero_optimization=dict(stage=2)),
         dict(type="DeepSpeedOptimWrapper")),
        ("memfit_autocast", dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=2)),
         dict(type="AmpOptimWrapper", dtype="bfloat16", fp32_modules=["loss"])),
    ):
        record = Record()
        torch.manual_seed(0)
        runner = Runner(model=Scorer(), work_dir=os.path.join(OUT, name), strategy=strategy,
                        train_dataloader=dict(batch_size=8, dataset=data), train_cfg=dict(by_epoch=False, max_iters=40),
                        optim_wrapper=dict(**wrapper, optimizer=dict(type="AdamW", lr=0.1, weight_decay=0.0)),
                        default_hooks=dict(checkpoint=None, logger=dict(interval=100)), custom_hooks=[record],
                        randomness=dict(seed=0))
        runner.train()
        out[name] = dict(losses=record.losses, bias=float(runner.strategy.full_state_dict(runner.model)["cls.bias"]))
    RESULTS["dino"] = out


def cmd_equivalence(cases: str) -> None:
    """ds_equivalence.py's CASEs (comma-separated) in this launch, each against its own one-process reference."""
    import ds_equivalence  # a sibling script: its folder is sys.path[0]

    out = {case: ds_equivalence.run_case(case, os.path.join(OUT, "equivalence")) for case in cases.split(",")}
    RESULTS["equivalence"] = dict(out, world_size=dist.get_world_size())


def main() -> None:
    commands = {"full": cmd_full, "kill": cmd_kill, "resume": cmd_resume, "single": cmd_single,
                "seed": cmd_seed, "dino": cmd_dino, "equivalence": cmd_equivalence}
    for spec in sys.argv[1:]:
        name, _, arg = spec.partition(":")
        commands[name](arg)
        write_result(RESULTS)  # after every command: what finished is on disk even if a later one dies
    dist.barrier()


if __name__ == "__main__":
    main()
