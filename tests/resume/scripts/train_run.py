"""One training run for the resume tests, started in a subprocess so that it can be SIGKILLed.

    python train_run.py '<json options>'

Options: ``work_dir``, ``log`` (file the per-iteration losses are appended to), ``by_epoch``,
``num_workers``, ``accumulative_counts``, ``resume``, ``kill`` (where to SIGKILL this process):

- ``"before:K"``: when K iterations are done, before the next one starts;
- ``"after:K"``: after the hooks of the K-th iteration (so after the checkpoint ``iter_K.pth``);
- ``"save:NAME"``: in the middle of writing checkpoint NAME, e.g. ``iter_25.pth`` (half of its
  bytes are in the temporary file);
- ``"pointer:NAME"``: after NAME is complete, before last_checkpoint is pointed at it.

The model has dropout, the data random crops and flips, the step bf16 autocast and gradient
accumulation: every source of randomness and every piece of state an exact resume must restore.
Each loss is written as ``float.hex()`` so the test compares the float32 values bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys

import torch

import memfit.checkpoint
from memfit.hooks import Hook
from memfit.model import ImageClassifier
from memfit.runner import Runner
from memfit.testing import TinyNet, augmented_shapes

opts = json.loads(sys.argv[1])


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class LossRecorder(Hook):
    """Appends ``iter loss_hex`` per iteration and ``resumed iter`` after a resume (line-buffered:
    what was written survives a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)

    def after_load_checkpoint(self, runner, checkpoint) -> None:
        self.file.write(f"resumed {checkpoint['loop']['iter']}\n")

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.file.write(f"{runner.iter} {outputs['loss'].item().hex()}\n")


class KillAt(Hook):
    """SIGKILL this process once K iterations are done: before the next one starts, or at the end
    of the K-th iteration's hooks (this hook runs last, after the CheckpointHook)."""

    priority = "LOWEST"

    def __init__(self, when: str, k: int) -> None:
        self.when, self.k = when, k

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self.when == "before" and runner.iter == self.k:
            die()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.when == "after" and runner.iter + 1 == self.k:
            die()


def kill_inside_save(name: str) -> None:
    """Make torch.save write half of checkpoint ``name`` to its temporary file, then die."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if os.path.basename(getattr(f, "name", "")).startswith(f".{name}.tmp-"):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            die()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def kill_before_pointer(name: str) -> None:
    real_write_latest = memfit.checkpoint.write_latest

    def write_latest(work_dir, filename):
        if os.path.basename(str(filename)) == name:
            die()
        return real_write_latest(work_dir, filename)

    memfit.checkpoint.write_latest = write_latest


def main() -> None:
    kill = opts.get("kill")
    hooks: list[Hook] = [LossRecorder(opts["log"])]
    if kill:
        when, what = kill.split(":", 1)
        if when in ("before", "after"):
            hooks.append(KillAt(when, int(what)))
        elif when == "save":
            kill_inside_save(what)
        elif when == "pointer":
            kill_before_pointer(what)
    by_epoch = opts.get("by_epoch", True)
    # 40 samples / batch 4 = 10 iterations per epoch; 3 epochs or 30 iterations either way.
    train_cfg = dict(by_epoch=True, max_epochs=3, val_interval=1) if by_epoch else \
        dict(by_epoch=False, max_iters=30, val_interval=10)
    runner = Runner(
        # Built by the runner, after it seeded the RNGs, so every run starts from the same weights.
        model=dict(type=ImageClassifier, backbone=dict(type=TinyNet)),
        work_dir=opts["work_dir"],
        train_dataloader=dict(batch_size=4, num_workers=opts.get("num_workers", 0),
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              dataset=augmented_shapes("train", 40, True)),
        val_dataloader=dict(batch_size=8, sampler=dict(type="DefaultSampler", shuffle=False),
                            dataset=augmented_shapes("val", 16, False)),
        val_evaluator=dict(type="Accuracy"),
        val_cfg=dict(),
        train_cfg=train_cfg,
        optim_wrapper=dict(type="AmpOptimWrapper", dtype="bfloat16",
                           accumulative_counts=opts.get("accumulative_counts", 3),
                           optimizer=dict(type="AdamW", lr=3e-3, weight_decay=0.01)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.2, by_epoch=False, begin=0, end=8),
                         dict(type="CosineAnnealingLR", by_epoch=False, begin=8, eta_min=1e-4)],
        default_hooks=dict(
            logger=dict(interval=5),
            checkpoint=dict(type="CheckpointHook", interval=5, by_epoch=False, max_keep_ckpts=2,
                            save_best="accuracy", rule="greater", save_last=True),
        ),
        custom_hooks=hooks,
        resume=opts.get("resume", False),
        randomness=dict(seed=1234),
    )
    runner.train()


if __name__ == "__main__":
    main()
