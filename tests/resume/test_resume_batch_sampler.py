"""A run whose loader batches with AspectRatioBatchSampler (MMDetection's dataset configs) resumes mid-epoch on the
next batch it had not trained, bit-exactly: the batch sampler's held-back images are not a sampler position."""

from __future__ import annotations

import torch

from memfit.checkpoint import load_checkpoint
from memfit.hooks import Hook


class Oriented:
    """The resume kit's samples, each an 'image' of seeded random orientation (``get_data_info``)."""

    def __init__(self, samples: list) -> None:
        self.samples = samples
        g = torch.Generator().manual_seed(2)
        self.hw = torch.randint(50, 150, (len(samples), 2), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]

    def get_data_info(self, i: int) -> dict:
        return dict(height=self.hw[i][0], width=self.hw[i][1])


class Batches(Hook):
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.rows.append((runner.iter, batch_idx, data_batch[0].sum().item(), outputs["loss"].item()))


def test_resume_mid_epoch_continues_with_the_next_untrained_batch(tmp_path, kit):
    dataset = Oriented(kit.samples())
    common = dict(
        train_cfg=dict(by_epoch=True, max_epochs=2),
        train_dataloader=dict(batch_size=4, dataset=dataset, sampler=dict(type="DefaultSampler", shuffle=True),
                              batch_sampler=dict(type="AspectRatioBatchSampler")),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=3, by_epoch=False, save_last=False)),
    )
    full = Batches()
    kit.make_runner(tmp_path / "full", custom_hooks=[full], **common).train()
    assert len(full.rows) == 16  # 8 batches an epoch, as without the batch sampler
    ckpt = tmp_path / "full" / "iter_3.pth"
    assert load_checkpoint(ckpt)["sampler"]["consumed"] == 12

    resumed = Batches()
    kit.make_runner(tmp_path / "resumed", custom_hooks=[resumed], resume=str(ckpt), **common).train()
    assert resumed.rows == full.rows[3:]
