"""The small config the auto-fit and command-line tests plan, bench and train.

A 2-block ViT (width 32) on 32 px shapes, batch 1, SGD with momentum: its activations, not its
model state, set the peak, so the plans' peaks spread (0.45-0.65 MB on CPU) and a budget between
them decides something. Batch 1 leaves out the micro-batch plans: half the fake steps to plan.
Written as a config file, as ``memfit`` reads it.
"""

from pathlib import Path

import pytest

TINY = """\
_data = dict(type='ShapesDataset', image_size=32, num_classes=4)
model = dict(type='TimmClassifier', model_name='vit_tiny_patch16_224', num_classes=4, img_size=32, patch_size=4,
             embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.0)
train_dataloader = dict(batch_size=1, num_workers=0, dataset=dict(**_data, num_samples=8),
                        sampler=dict(type='DefaultSampler', shuffle=True))
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01, momentum=0.9))
train_cfg = dict(by_epoch=False, max_iters=2)
work_dir = {work_dir!r}
"""


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config(directory)``: write the config there (work_dir: ``directory/work``); its path."""

    def write(directory: Path) -> Path:
        path = Path(directory) / "tiny.py"
        path.write_text(TINY.format(work_dir=str(Path(directory) / "work")))
        return path

    return write


@pytest.fixture(scope="module", autouse=True)
def _plan_in_process():
    """Fake steps run in this process, not in forked workers: the tests' models are tiny, and a worker
    forked after this process ran a fake backward cannot run one (memfit/planner/runs.py then falls
    back to this process; tests/planner/test_runs.py covers that). Module-scoped, so the modules' own
    module-scoped fixtures plan under it too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMFIT_PLAN_WORKERS", "1")
        yield


@pytest.fixture
def constants_time_model(monkeypatch):
    """The step-time model's constants, whatever profiles the package holds (memfit/planner/profiles/): for tests
    of the constants' own arithmetic."""
    from memfit.planner import time_profile

    monkeypatch.setattr(time_profile, "installed", lambda *a, **k: ())
