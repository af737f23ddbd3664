"""Training and evaluation loops: epoch- or iteration-based training, and validation/test.

A loop only iterates data, calls the model's ``train_step``/``val_step`` and the runner's hooks; the
strategy and the optimizer wrapper do the rest. The loop's position (epoch, iteration, batch within
the epoch) is what a checkpoint stores to resume at the next unseen batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memfit.checkpoint import capture_rng_state, restore_rng_state
from memfit.data.batch_sampler import batch_size_of
from memfit.data.prefetch import prefetch
from memfit.data.sampler import InfiniteSampler
from memfit.dist import get_world_size
from memfit.errors import ConfigError


def _sampler_of(loader: Any) -> Any:
    sampler = getattr(loader, "sampler", None)
    if not hasattr(sampler, "advance"):
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return sampler


def _device_of(runner: Any) -> torch.device | None:
    return getattr(getattr(runner, "strategy", None), "device", None)


def _iterate(loader: Any, device: torch.device | None = None) -> Iterator:
    """The loader's batches; on CUDA with the next one already on its way to ``device``."""
    # Creating a DataLoader iterator draws a worker seed from the global RNG; fork it so that a
    # resumed run, which creates its iterator at another point, keeps the same RNG stream.
    with torch.random.fork_rng(devices=[]):
        batches = iter(loader)
    return batches if device is None else prefetch(batches, device)


class TrainLoop:
    """Epoch-based (``by_epoch=True``, ``max_epochs``) or iteration-based (``max_iters``) training."""

    def __init__(self, runner: Any, dataloader: Any, *, by_epoch: bool, max_epochs: int | None,
                 max_iters: int | None, val_interval: int = 1, val_begin: int = 1) -> None:
        self.runner = runner
        self.dataloader = dataloader
        self.by_epoch = by_epoch
        self.sampler = _sampler_of(dataloader)
        # The full epoch's length (len(dataloader) shrinks to what remains once a resume loads the sampler).
        self.iters_per_epoch = len(dataloader)
        if self.iters_per_epoch == 0:
            raise ConfigError("train_dataloader has no batches: check its dataset's size, batch_size and drop_last")
        if by_epoch and isinstance(self.sampler, InfiniteSampler):  # MMEngine's epoch loop would run on forever
            raise ConfigError("train_dataloader.sampler: an InfiniteSampler never ends an epoch: use DefaultSampler "
                              "with train_cfg by_epoch=True, or train by iterations: train_cfg=dict(by_epoch=False, "
                              "max_iters=N)")
        if by_epoch:
            self.max_epochs = int(max_epochs)
            self.max_iters = self.max_epochs * self.iters_per_epoch
        else:
            self.max_iters = int(max_iters)
            self.max_epochs = -(-self.max_iters // self.iters_per_epoch)
        self.val_interval, self.val_begin = val_interval, val_begin
        self.epoch = 0  # current epoch (iteration-based: passes over the data so far)
        self.iter = 0  # completed iterations
        self.batch_in_epoch = 0  # completed batches in the current epoch
        self._epoch_end = False
        self._iter_end = False
        self._validating = False

    # -- position (checkpointed) ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position to continue from. During the epoch-end hooks (scheduler stepped, checkpoint
        being saved) that is the start of the next epoch; during the iteration-end hooks, where
        ``self.iter`` is still the index of the iteration just run (MMEngine's ``runner.iter``), it
        is the iteration after it."""
        if self._epoch_end:
            return {"epoch": self.epoch + 1, "iter": self.iter, "batch_in_epoch": 0}
        done = self.iter + 1 if self._iter_end else self.iter
        return {"epoch": self.epoch, "iter": done, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.iter, self.batch_in_epoch = state["epoch"], state["iter"], state["batch_in_epoch"]

    def is_last_iter_of_epoch(self, batch_idx: int) -> bool:
        return self.by_epoch and batch_idx + 1 == self.iters_per_epoch

    @property
    def done(self) -> bool:
        return self.iter >= self.max_iters

    def position(self) -> str:
        """Where the loop is, 1-based, for a failure message: 'at epoch 2, iteration 37' (the iteration
        running, or whose hooks run), 'at the end of epoch 2', 'in the validation after epoch 2'."""
        if self._validating:
            return f"in the validation after epoch {self.epoch}" if self.by_epoch else \
                f"in the validation after iteration {self.iter}"
        if self._epoch_end:
            return f"at the end of epoch {self.epoch + 1} (iteration {self.iter})"
        if self.done:
            return f"after its last iteration ({self.iter})"
        if self.by_epoch:
            return f"at epoch {self.epoch + 1}, iteration {self.iter + 1}"
        return f"at iteration {self.iter + 1}"

    def _validate(self) -> None:
        self._validating = True  # left set if it raises: position() then names the validation
        self.runner.val_loop.run()
        self._validating = False

    # -- running -------------------------------------------------------------------------------
    def run(self) -> Any:
        runner = self.runner
        runner.call_hook("before_train")
        if self.by_epoch:
            while self.epoch < self.max_epochs:
                self.run_epoch()
                if self._val_due(self.epoch):
                    self._validate()
        else:
            self._run_iters()
        runner.call_hook("after_train")
        return runner.model

    def _val_due(self, count: int) -> bool:
        return (
            self.runner.val_loop is not None
            and count >= self.val_begin
            and (count % self.val_interval == 0 or count == (self.max_epochs if self.by_epoch else self.max_iters))
        )

    def run_epoch(self) -> None:
        runner = self.runner
        runner.call_hook("before_train_epoch")
        runner.model.train()
        if runner.optim_wrapper is not None:
            runner.optim_wrapper.initialize_count_status(runner.model, self.batch_in_epoch, self.iters_per_epoch)
        if self.batch_in_epoch < self.iters_per_epoch:
            # Run until the loader is exhausted: after a resume at another world size the sampler
            # holds a different number of remaining batches than iters_per_epoch - batch_in_epoch.
            batches = _iterate(self.dataloader, _device_of(runner))
            for batch_idx, data_batch in enumerate(batches, start=self.batch_in_epoch):
                self.run_iter(batch_idx, data_batch)
        self._epoch_end = True
        runner.call_hook("after_train_epoch")
        self._epoch_end = False
        self.epoch += 1
        self.batch_in_epoch = 0

    def _run_iters(self) -> None:
        runner = self.runner
        runner.model.train()
        if runner.optim_wrapper is not None:
            runner.optim_wrapper.initialize_count_status(runner.model, self.iter, self.max_iters)
        runner.call_hook("before_train_epoch")
        data = None
        while self.iter < self.max_iters:
            if data is None or self.batch_in_epoch >= self.iters_per_epoch:
                if self.batch_in_epoch >= self.iters_per_epoch:
                    self.epoch += 1
                    self.batch_in_epoch = 0
                if hasattr(self.sampler, "set_epoch"):
                    self.sampler.set_epoch(self.epoch)
                data = _iterate(self.dataloader, _device_of(runner))
            self.run_iter(self.batch_in_epoch, next(data))
            if self._val_due(self.iter):
                self._validate()
                runner.model.train()
        runner.call_hook("after_train_epoch")

    def run_iter(self, batch_idx: int, data_batch: Any) -> None:
        runner = self.runner
        runner.call_hook("before_train_iter", batch_idx=batch_idx, data_batch=data_batch)
        outputs = runner.model.train_step(data_batch, optim_wrapper=runner.optim_wrapper)
        if hasattr(self.sampler, "advance"):
            self.sampler.advance(batch_size_of(self.dataloader) * get_world_size())
        self.batch_in_epoch = batch_idx + 1
        self._iter_end = True
        runner.call_hook("after_train_iter", batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        self._iter_end = False
        self.iter += 1


class EvalLoop:
    """One pass over a validation or test loader: ``val_step`` per batch, metrics at the end."""

    def __init__(self, runner: Any, dataloader: Any, evaluator: Any, mode: str = "val", fp16: bool = False) -> None:
        self.runner = runner
        self.dataloader = dataloader
        self.evaluator = evaluator
        self.mode = mode
        self.fp16 = fp16

    def run(self) -> dict:
        runner, mode = self.runner, self.mode
        runner.call_hook(f"before_{mode}")
        runner.call_hook(f"before_{mode}_epoch")
        runner.model.eval()
        step = runner.model.val_step if mode == "val" else runner.model.test_step
        # fp32 unless val_cfg/test_cfg ask for fp16 (MMEngine's ValLoop), then the run's precision.
        autocast = runner.strategy.precision.eval_autocast(self.fp16)
        # Validation must not move the training RNG streams: a run resumed from a checkpoint saved
        # before (or during) validation does not validate again, yet has to draw the same dropout
        # masks afterwards. Restored before after_{mode}_epoch, where the best checkpoint is saved.
        rng = capture_rng_state()
        with torch.no_grad():
            for idx, batch in enumerate(self.dataloader):
                runner.call_hook(f"before_{mode}_iter", batch_idx=idx, data_batch=batch)
                with autocast:
                    outputs = step(batch)
                self.evaluator.process(data_samples=outputs, data_batch=batch)
                runner.call_hook(f"after_{mode}_iter", batch_idx=idx, data_batch=batch, outputs=outputs)
        size = len(self.dataloader.dataset) if hasattr(self.dataloader, "dataset") else None
        metrics = self.evaluator.evaluate(size)
        restore_rng_state(rng)
        runner.call_hook(f"after_{mode}_epoch", metrics=metrics)
        runner.call_hook(f"after_{mode}")
        return metrics
