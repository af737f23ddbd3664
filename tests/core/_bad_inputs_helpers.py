"""The bad-input corpus's shared parts (tests/core/test_bad_inputs.py, tests/core/test_bad_inputs_training.py):
a tiny model, the config it trains with and its overrides, and the checks every bad input passes (one line,
nothing already written lost)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import nn

from memfit.checkpoint import load_checkpoint, read_latest
from memfit.model import BaseModel

SHAPES = dict(type="ShapesDataset", num_samples=8, image_size=16, num_classes=2)
QUIET = dict(checkpoint=None, logger=dict(interval=100, tensorboard=False))


class Tiny(BaseModel):
    """Linear classifier over 16x16 shapes; the ``bad_at``-th loss of this run is multiplied by ``bad``."""

    def __init__(self, width: int = 4, bad_at: int | None = None, bad: float = float("nan")) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, width)
        self.head = nn.Linear(width, 2)
        self.bad_at, self.bad, self.calls = bad_at, bad, 0

    def forward(self, img, label=None, mode="tensor", **_):
        out = self.head(self.fc(img.flatten(1)).relu())
        if mode == "loss":
            self.calls += 1
            loss = F.cross_entropy(out, label)
            return {"loss": loss * self.bad if self.calls == self.bad_at else loss}
        if mode == "predict":
            return out.softmax(-1), label
        return out


def hooks(**entries: Any) -> dict:
    """default_hooks: quiet ones (no checkpoints, no TensorBoard) with ``entries`` on top."""
    return {**QUIET, **entries}


def config(**overrides: Any) -> dict:
    """A config that trains Tiny for one epoch of 2 iterations; ``overrides`` replace top-level keys."""
    cfg = dict(
        model=dict(type=Tiny),
        work_dir="w",
        train_dataloader=dict(batch_size=4, dataset=SHAPES),
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        default_hooks=hooks(),
        randomness=dict(seed=0),
    )
    cfg.update(overrides)
    return cfg


def loader(**kw: Any) -> dict:
    """A train/val dataloader config over 8 shapes, batch 4; ``kw`` replace or add keys."""
    return {"batch_size": 4, "dataset": SHAPES, **kw}


def optim(**kw: Any) -> dict:
    return dict(optimizer=dict(type="SGD", lr=0.1, **kw))


VAL = dict(val_dataloader=loader(), val_cfg=dict())


def one_line(exc: BaseException, *needles: str) -> str:
    """The message is one line and holds every needle (the key/path/value and the fix)."""
    msg = str(exc)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_nothing_lost(work_dir: Path, name: str = "epoch_1.pth", sha: str | None = None) -> None:
    """last_checkpoint still names ``name``, which loads (unchanged), and no temporary file is left."""
    assert read_latest(work_dir) == work_dir / name
    assert load_checkpoint(work_dir / name)["meta"]["memfit_version"]
    if sha is not None:
        assert digest(work_dir / name) == sha
    assert not [p.name for p in work_dir.iterdir() if ".tmp-" in p.name]
