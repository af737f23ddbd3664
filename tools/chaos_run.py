"""One training run of tools/chaos.py on 1 or 2 CPU processes (gloo), and maybe killed. tools/chaos.py starts it
with ``memfit.testing.launch``; torchrun runs it too:

    python -m torch.distributed.run --nproc-per-node 2 tools/chaos_run.py '<json options>'

Options: ``work_dir``, ``log`` (rank 0 appends ``iteration float.hex(global loss)`` per iteration and
``resumed N`` after a resume), ``strategy`` (a key of STRATEGIES below), ``amp`` (bf16 autocast),
``resume``, ``batch`` (per rank, default 4), ``dropout`` (default on) and ``kill``, where to SIGKILL the
whole run (every rank and their parent: its process group):

- ``before:K``: once K iterations are done, before the next starts (inside an accumulation window when K
  is not a multiple of the accumulation);
- ``save:K``: inside the checkpoint save after iteration K, once its files are written and before they are
  published under their final name (or, for a directory, between its shard files and that rename);
- ``pointer:K``: after the checkpoint of iteration K is complete, before ``last_checkpoint`` names it;
- ``eval:K``: inside the validation after iteration K, after its first batch.

The model has dropout and the data random crops and flips; AdamW, warm-up then cosine, accumulation 2,
checkpoints every 3 iterations (inside accumulation windows too) and validation every 4.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import memfit.checkpoint
from memfit import dist
from memfit.hooks import Hook
from memfit.model import ImageClassifier
from memfit.runner import Runner
from memfit.testing import TinyNet, augmented_shapes

ITERS, ACCUMULATION, SAVE_EVERY, VAL_EVERY = 12, 2, 3, 4
STRATEGIES = {
    "single": None,
    "ddp": dict(type="DDPStrategy"),
    "zero1": dict(type="DDPStrategy", zero=True),
    "fsdp": dict(type="FSDPStrategy"),
    "deepspeed_zero2": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=2)),
    "deepspeed_zero3": dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=3)),
}


def die() -> None:
    """SIGKILL every process of this run at once, as a node failure or ``scancel -s KILL`` would."""
    os.killpg(os.getpgid(0), signal.SIGKILL)


class Chaos(Hook):
    """Records the global loss of every iteration (rank 0, line-buffered: it survives a SIGKILL) and
    kills the run at ``before:K`` / ``eval:K``."""

    # Before the CheckpointHook: an iteration's loss is recorded before a kill inside its checkpoint's save.
    priority = "HIGHEST"

    def __init__(self, log: str, kill: str | None) -> None:
        self.file = open(log, "a", buffering=1) if int(os.environ.get("RANK", 0)) == 0 else None
        when, k = (kill.split(":") if kill else (None, "-1"))
        self.when, self.k = when, int(k)

    def after_load_checkpoint(self, runner, checkpoint) -> None:
        if self.file:
            self.file.write(f"resumed {checkpoint['loop']['iter']}\n")

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self.when == "before" and runner.iter == self.k and dist.is_main_process():
            die()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        loss = float(dist.all_reduce_mean(outputs["loss"].detach().float()))
        if self.file:
            self.file.write(f"{runner.iter} {loss.hex()}\n")

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.when == "eval" and runner.iter == self.k and dist.is_main_process():
            die()


def kill_inside_saves(when: str, k: int) -> None:
    """``save:K``: die where a checkpoint of iteration K would be published (a file's or a directory's final
    rename); ``pointer:K``: die before ``last_checkpoint`` is pointed at it."""
    name = f"iter_{k}.pth"
    if when == "save":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if os.path.basename(str(dst)) == name:
                die()
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif when == "pointer":
        real_write_latest = memfit.checkpoint.write_latest

        def write_latest(work_dir, filename):
            if os.path.basename(str(filename)) == name:
                die()
            return real_write_latest(work_dir, filename)

        memfit.checkpoint.write_latest = write_latest  # memfit.resume imports it when it saves


def main() -> None:
    opts = json.loads(sys.argv[1])
    kill = opts.get("kill")
    if kill and kill.split(":")[0] in ("save", "pointer"):
        kill_inside_saves(kill.split(":")[0], int(kill.split(":")[1]))
    wrapper = dict(type="AmpOptimWrapper", dtype="bfloat16") if opts.get("amp") else dict(type="OptimWrapper")
    runner = Runner(
        model=dict(type=ImageClassifier, backbone=dict(type=TinyNet, dropout=opts.get("dropout", True))),
        work_dir=opts["work_dir"],
        train_dataloader=dict(batch_size=opts.get("batch", 4), num_workers=0,
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              dataset=augmented_shapes("train", 32, True)),
        val_dataloader=dict(batch_size=8, sampler=dict(type="DefaultSampler", shuffle=False),
                            dataset=augmented_shapes("val", 16, False)),
        val_evaluator=dict(type="Accuracy"),
        val_cfg=dict(),
        train_cfg=dict(by_epoch=False, max_iters=ITERS, val_interval=VAL_EVERY),
        optim_wrapper=dict(wrapper, accumulative_counts=ACCUMULATION,
                           optimizer=dict(type="AdamW", lr=3e-3, weight_decay=0.01)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.2, by_epoch=False, begin=0, end=4),
                         dict(type="CosineAnnealingLR", by_epoch=False, begin=4, eta_min=1e-4)],
        default_hooks=dict(logger=dict(interval=4),
                           checkpoint=dict(type="CheckpointHook", interval=SAVE_EVERY, by_epoch=False,
                                           max_keep_ckpts=2, save_last=True)),
        custom_hooks=[Chaos(opts["log"], kill)],
        strategy=STRATEGIES[opts["strategy"]],
        resume=opts.get("resume", False),
        randomness=dict(seed=1234),
    )
    runner.train()


if __name__ == "__main__":
    main()
