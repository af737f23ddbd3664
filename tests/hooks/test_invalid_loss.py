"""CheckInvalidLossHook across processes: a nan on one rank stops every rank at the same iteration.

The single-process behaviour (stop naming the iteration, interval, skip) is pinned in
tests/core/test_bad_inputs_training.py.
"""

from __future__ import annotations

import textwrap

from memfit.testing import launch, read_results

SCRIPT = textwrap.dedent("""
    import os
    import torch.nn.functional as F
    from torch import nn
    from memfit.errors import TrainingError
    from memfit.model import BaseModel
    from memfit.runner import Runner
    from memfit.testing import write_result

    class Tiny(BaseModel):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * 16 * 16, 2)
            self.calls = 0

        def forward(self, img, label=None, mode='tensor', **_):
            out = self.fc(img.flatten(1))
            if mode != 'loss':
                return out
            self.calls += 1
            loss = F.cross_entropy(out, label)
            return {'loss': loss * float('nan') if self.calls == 2 and os.environ['RANK'] == '1' else loss}

    runner = Runner(
        model=Tiny(), work_dir=os.environ['MEMFIT_TEST_OUT'] + '/w', launcher='pytorch', strategy='ddp',
        train_dataloader=dict(batch_size=2, dataset=dict(type='ShapesDataset', num_samples=16, image_size=16,
                                                         num_classes=2)),
        train_cfg=dict(by_epoch=True, max_epochs=2), optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)),
        default_hooks=dict(checkpoint=None, logger=dict(interval=100, tensorboard=False)), randomness=dict(seed=0))
    try:
        runner.train()
        write_result('finished')
    except TrainingError as exc:
        write_result(str(exc))
""")


def test_nan_on_one_rank_stops_both_at_the_same_iteration(tmp_path):
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(SCRIPT)
    proc = launch(script, 2, out_dir=tmp_path / "out", timeout=240)
    results = read_results(tmp_path / "out", 2, proc)
    assert all(r.startswith("the loss is nan at epoch 1, iteration 2:") for r in results), results
