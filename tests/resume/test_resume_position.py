"""Where a resumed run continues: the next unseen batch of the same epoch, inside an accumulation
window, with the same losses; and validation does not move the training RNG streams."""

from __future__ import annotations

import pytest
import torch

from memfit.checkpoint import load_checkpoint
from memfit.hooks import Hook


class BatchRecorder(Hook):
    """(iteration, epoch, batch index, loss, a fingerprint of the batch's inputs) per iteration."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        x = data_batch[0]
        self.rows.append((runner.iter, runner.epoch, batch_idx, outputs["loss"].item(), x.sum().item()))


# A per-iteration schedule with accumulation steps the LR after micro-steps that did not step the
# optimizer (MMEngine's behaviour too).
# ahead: the loop takes each batch one step early as on CUDA (memfit.data.prefetch), here on the CPU.
@pytest.mark.parametrize("by_epoch, sampler, ahead", [(True, "DefaultSampler", False),
                                                      (False, "InfiniteSampler", False),
                                                      (True, "DefaultSampler", True), (False, "InfiniteSampler", True)])
def test_resume_mid_epoch_inside_accumulation_window(tmp_path, kit, by_epoch, sampler, ahead, monkeypatch):
    import functools

    import memfit.loops
    from memfit.data.prefetch import prefetch

    monkeypatch.setattr(memfit.loops, "prefetch", functools.partial(prefetch, ahead=ahead))
    train_cfg = dict(by_epoch=True, max_epochs=2) if by_epoch else dict(by_epoch=False, max_iters=16)
    common = dict(
        train_cfg=train_cfg,
        train_dataloader=dict(batch_size=4, dataset=kit.samples(), sampler=dict(type=sampler, shuffle=True)),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9), accumulative_counts=3),
        param_scheduler=dict(type="LinearLR", start_factor=0.5, by_epoch=False, end=12),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=5, by_epoch=False, save_last=False)),
    )
    full = BatchRecorder()
    kit.make_runner(tmp_path / "full", custom_hooks=[full], **common).train()
    ckpt = tmp_path / "full" / "iter_5.pth"
    state = load_checkpoint(ckpt)
    assert state["loop"] == {"epoch": 0, "iter": 5, "batch_in_epoch": 5}
    assert state["sampler"]["consumed"] == 20
    assert state["optim_wrapper"]["inner_count"] == 5 and "grads" in state  # 5 % 3: window open

    resumed = BatchRecorder()
    kit.make_runner(tmp_path / "resumed", custom_hooks=[resumed], resume=str(ckpt), **common).train()
    # Continues at batch 5 of epoch 0 (no replayed or skipped batch), bit-exact to the end.
    assert resumed.rows[0][:3] == (5, 0, 5)
    assert resumed.rows == full.rows[5:]


def test_resume_without_saved_window_gradients_diverges(tmp_path, kit):
    """The partial gradients in the checkpoint matter: dropping them changes the next update."""
    common = dict(
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1), accumulative_counts=3),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=5, by_epoch=False, save_last=False)),
    )
    full = BatchRecorder()
    kit.make_runner(tmp_path / "full", custom_hooks=[full], **common).train()
    state = load_checkpoint(tmp_path / "full" / "iter_5.pth")
    del state["grads"]
    torch.save(state, tmp_path / "no_grads.pth")
    resumed = BatchRecorder()
    kit.make_runner(tmp_path / "resumed", custom_hooks=[resumed], resume=str(tmp_path / "no_grads.pth"),
                    **common).train()
    assert resumed.rows[0] == full.rows[5]  # same weights until the window closes at iteration 6
    assert resumed.rows[2][3] != full.rows[7][3]


def test_validation_does_not_move_the_training_rng(tmp_path, kit):
    with_val, without = BatchRecorder(), BatchRecorder()
    cfg = dict(by_epoch=True, max_epochs=3, val_interval=1)
    kit.make_runner(tmp_path / "a", val=True, train_cfg=cfg, custom_hooks=[with_val]).train()
    kit.make_runner(tmp_path / "b", train_cfg=cfg, custom_hooks=[without]).train()
    assert with_val.rows == without.rows
