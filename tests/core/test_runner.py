"""Runner: loops, hooks' view of the state, schedulers, accumulation through the runner, errors."""

import json
from pathlib import Path

import pytest
import torch

from memfit.errors import ConfigError
from memfit.hooks import Hook
from memfit.runner import Runner
from memfit.testing import regression_data, regression_model


def _loader(bs, n=32):
    return dict(batch_size=bs, dataset=regression_data(n), sampler=dict(type="DefaultSampler", shuffle=False))


def _runner(work_dir, **kw):
    base = dict(
        model=regression_model(),
        work_dir=str(work_dir),
        train_dataloader=_loader(8),
        train_cfg=dict(by_epoch=True, max_epochs=2),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
        default_hooks=dict(checkpoint=None, logger=dict(interval=1)),
        randomness=dict(seed=0),
    )
    base.update(kw)
    return Runner(**base)


def test_accumulation_through_runner_equals_large_batch():
    small = _runner("a", train_dataloader=_loader(2),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05), accumulative_counts=4))
    large = _runner("b", train_dataloader=_loader(8))
    small.train()
    large.train()
    for p, q in zip(small.model.parameters(), large.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_hooks_see_mmengine_state():
    seen = []

    class Spy(Hook):
        def before_train_epoch(self, runner):
            seen.append(("epoch", runner.epoch))

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            seen.append(("iter", runner.iter, batch_idx, sorted(outputs), runner.max_iters))

    r = _runner("w", custom_hooks=[Spy()])
    r.train()
    iters = [s for s in seen if s[0] == "iter"]
    assert [s[1] for s in iters] == list(range(8))
    assert [s[2] for s in iters] == [0, 1, 2, 3] * 2
    assert all(s[3] == ["loss"] and s[4] == 8 for s in iters)
    assert [s for s in seen if s[0] == "epoch"] == [("epoch", 0), ("epoch", 1)]


def test_iteration_based_with_warmup_and_val():
    from memfit.evaluator import BaseMetric

    class MSE(BaseMetric):
        def process(self, data_batch, data_samples):
            out, y = data_samples
            self.results.append(((out - y) ** 2).sum().item())

        def compute_metrics(self, results):
            return {"mse": sum(results)}

    lrs, vals = [], []

    class Spy(Hook):
        def before_train_iter(self, runner, batch_idx, data_batch=None):
            lrs.append(runner.optim_wrapper.get_lr()["lr"][0])

        def after_val_epoch(self, runner, metrics=None):
            vals.append((runner.iter, metrics["mse"]))

    r = _runner(
        "w", train_cfg=dict(by_epoch=False, max_iters=10, val_interval=5),
        val_dataloader=_loader(8, 16), val_evaluator=dict(type=MSE), val_cfg=dict(),
        param_scheduler=dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=4),
        custom_hooks=[Spy()],
    )
    r.train()
    assert r.iter == 10 and len(lrs) == 10
    # MMEngine's LinearLR spreads the warm-up over end - begin - 1 = 3 steps: 0.05 * (0.1 + 0.9 * t / 3).
    torch.testing.assert_close(lrs[:5], [0.005, 0.02, 0.035, 0.05, 0.05])
    assert lrs[5:] == pytest.approx([0.05] * 5)
    assert [v[0] for v in vals] == [5, 10] and vals[1][1] < vals[0][1]


def test_epoch_scheduler_and_log_line(capsys):
    r = _runner("w", train_cfg=dict(by_epoch=True, max_epochs=3),
                param_scheduler=dict(type="MultiStepLR", milestones=[1], gamma=0.1))
    r.train()
    assert r.optim_wrapper.get_lr()["lr"][0] == pytest.approx(0.005)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "Epoch(train)  [2][4/4]" in x)
    for field in ("lr: 5.0000e-03", "eta: ", "time: ", "data_time: ", "memory: ", "loss: "):
        assert field in line
    rows = [json.loads(x) for x in next(Path("w").glob("*/scalars.jsonl")).read_text().splitlines()]
    assert len(rows) == 12 and all({"loss", "lr", "time", "data_time", "memory"} <= set(r) for r in rows)


def test_timm_classifier_learns_shapes():
    r = Runner(
        model=dict(type="TimmClassifier", model_name="resnet18", num_classes=2, pretrained=False),
        work_dir="w",
        train_dataloader=dict(batch_size=16, dataset=dict(type="ShapesDataset", num_samples=256, image_size=32,
                                                          num_classes=2)),
        val_dataloader=dict(batch_size=64, sampler=dict(type="DefaultSampler", shuffle=False),
                            dataset=dict(type="ShapesDataset", num_samples=128, image_size=32, num_classes=2,
                                         split="val")),
        val_evaluator=dict(type="Accuracy"),
        val_cfg=dict(),
        train_cfg=dict(by_epoch=True, max_epochs=3),
        optim_wrapper=dict(type="AmpOptimWrapper", optimizer=dict(type="AdamW", lr=2e-3)),
        default_hooks=dict(checkpoint=None),
        randomness=dict(seed=0),
    )
    accs = []

    class Spy(Hook):
        def after_val_epoch(self, runner, metrics=None):
            accs.append(metrics["accuracy/top1"])

    r.register_hook(Spy())
    r.train()
    assert max(accs) > 70.0, accs  # chance is 50%


def test_unknown_names_and_keys_are_one_line_errors():
    with pytest.raises(ConfigError, match="did you mean 'SGD'"):
        _runner("w", optim_wrapper=dict(optimizer=dict(type="SDG", lr=0.1))).train()
    with pytest.raises(ConfigError, match="accumulative_counts"):
        _runner("w", optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1), accumulative_count=2)).train()
    with pytest.raises(ConfigError, match="max_epochs"):
        _runner("w", train_cfg=dict(by_epoch=True, max_epoch=2))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        _runner("w", cfg=dict(activation_checkpointin=["fc"]))
    with pytest.raises(ConfigError, match="LoggerHook"):
        _runner("w", default_hooks=dict(logger=dict(type="LogerHook")))


def test_from_cfg_rejects_misspelt_top_level_key():
    cfg = dict(model=dict(type="TimmClassifier", model_name="resnet18"), work_dir="w", trian_cfg=dict())
    with pytest.raises(ConfigError, match="did you mean 'train_cfg'"):
        Runner.from_cfg(cfg)


def test_val_and_test_cfg_typos_fail_in_the_python_api_too():
    with pytest.raises(ConfigError, match="unknown config key 'val_cfg.fp61': did you mean 'fp16'"):
        _runner("w", val_cfg=dict(fp61=True))
    with pytest.raises(ConfigError, match="test_cfg.fp16 must be bool"):
        _runner("w", test_cfg=dict(fp16="yes"))
