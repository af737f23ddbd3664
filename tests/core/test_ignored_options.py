"""MMEngine options memfit cannot honour are never dropped silently: each maps onto memfit's
equivalent or logs one warning (once per process) naming the option and what to use instead."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from memfit import errors
from memfit.data import InfiniteSampler
from memfit.errors import warn_ignored
from memfit.hooks import Hook
from memfit.hooks.logger import LoggerHook
from memfit.model import BaseModel
from memfit.optim import AmpOptimWrapper
from memfit.runner import Runner
from memfit.strategies import DeepSpeedStrategy, FSDPStrategy


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees a process that has warned about nothing yet."""
    monkeypatch.setattr(errors, "_WARNED", set())


def _warnings(caplog, text: str) -> list[str]:
    # Until a Runner has set up the 'memfit' logger it also propagates to the root logger, so caplog's
    # handler can receive the same record twice: count records, not deliveries.
    records = {id(r): r for r in caplog.records}.values()
    return [r.getMessage() for r in records if r.name == "memfit" and r.levelname == "WARNING"
            and text in r.getMessage()]


class Regression(BaseModel):
    def __init__(self, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y, mode="tensor"):
        out = self.fc(x)
        return {"loss": (out - y).pow(2)} if mode == "loss" else (out, y)


def _runner(work_dir: str, **kw) -> Runner:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    base = dict(model=Regression(), work_dir=work_dir, randomness=dict(seed=0),
                train_dataloader=dict(batch_size=4, dataset=[(x[i], x[i].sum(0, keepdim=True)) for i in range(16)],
                                      sampler=dict(type="DefaultSampler", shuffle=False)),
                train_cfg=dict(by_epoch=True, max_epochs=1), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                default_hooks=dict(checkpoint=None, logger=dict(interval=2)))
    base.update(kw)
    return Runner(**base)


def _logger_hook(runner: Runner) -> LoggerHook:
    return next(h for h in runner.hooks if isinstance(h, LoggerHook))


def test_warn_ignored_names_the_option_once_per_process(caplog):
    warn_ignored("x.opt", "use y")
    warn_ignored("x.opt", "use y")
    assert _warnings(caplog, "x.opt") == ["x.opt has no effect in memfit: use y"]


def test_infinite_sampler_round_up_warns_and_changes_nothing(caplog):
    plain = InfiniteSampler(range(10), seed=1, num_replicas=2, rank=1)
    for _ in range(2):
        given = InfiniteSampler(range(10), seed=1, round_up=False, num_replicas=2, rank=1)
    assert len(_warnings(caplog, "InfiniteSampler.round_up has no effect")) == 1
    take = lambda s: [int(k) for _, k in zip(range(25), s)]
    assert take(given) == take(plain)


def test_amp_use_fsdp_warns_only_when_true(caplog):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    AmpOptimWrapper(opt, dtype="float32", use_fsdp=False)
    assert not _warnings(caplog, "use_fsdp")
    AmpOptimWrapper(opt, dtype="float32", use_fsdp=True)
    AmpOptimWrapper(opt, dtype="float32", use_fsdp=True)
    [msg] = _warnings(caplog, "optim_wrapper.use_fsdp has no effect")
    assert "strategy='fsdp'" in msg


def test_deepspeed_activation_checkpointing_warns_naming_memfits_switch(caplog):
    DeepSpeedStrategy(zero_optimization=dict(stage=2))
    assert not _warnings(caplog, "activation_checkpointing")
    DeepSpeedStrategy(activation_checkpointing=dict(partition_activations=True))
    DeepSpeedStrategy(config=dict(activation_checkpointing=dict(cpu_checkpointing=True)))  # the JSON form
    [msg] = _warnings(caplog, "DeepSpeedStrategy.activation_checkpointing has no effect")
    assert "cfg=dict(activation_checkpointing=[...])" in msg


def test_fsdp_skip_init_weights_skips_init_cfg():
    """FSDP2 in one process (a one-rank gloo group): init_cfg zeroes the Linear unless skip_init_weights=True,
    which keeps the weights the model was built with (lr=0: training moves nothing)."""
    zero = dict(type="Constant", val=0.0, layer="Linear")
    opt = dict(optimizer=dict(type="SGD", lr=0.0))
    weights = {}
    for skip in (False, True):
        runner = _runner(f"skip_{skip}", model=Regression(init_cfg=zero), optim_wrapper=opt,
                         strategy=FSDPStrategy(skip_init_weights=skip))
        runner.train()
        weight = runner.model.fc.weight
        assert type(weight).__name__ == "DTensor"  # sharded by FSDP2 in this process
        weights[skip] = weight.full_tensor()
    assert weights[False].abs().sum() == 0
    torch.testing.assert_close(weights[True], Regression().fc.weight, rtol=0, atol=0)


def test_log_processor_window_size_maps_and_the_rest_warns(caplog):
    losses: list[float] = []

    class Record(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            losses.append(float(outputs["loss"]))

    runner = _runner("w", log_processor=dict(type="LogProcessor", window_size=1, by_epoch=True, num_digits=4,
                                             custom_cfg=[dict(data_src="loss", method_name="max")]),
                     custom_hooks=[Record()])
    assert _logger_hook(runner).window_size == 1
    runner.train()
    rows = [json.loads(line) for line in (runner.log_dir / "scalars.jsonl").read_text().splitlines()]
    # Logged every 2 iterations over a window of 1: the loss of that iteration, not the 2-iteration mean.
    assert [r["loss"] for r in rows] == pytest.approx([losses[1], losses[3]], rel=1e-6)
    assert len(_warnings(caplog, "log_processor.custom_cfg has no effect")) == 1
    assert not _warnings(caplog, "num_digits") and not _warnings(caplog, "by_epoch")  # as memfit behaves anyway
    _runner("w2", log_processor=dict(by_epoch=False, window_size="epoch"))
    assert len(_warnings(caplog, "log_processor.by_epoch=False has no effect")) == 1
    assert len(_warnings(caplog, "log_processor.window_size='epoch' has no effect")) == 1


def test_visualizer_backends_decide_tensorboard(caplog):
    local = dict(type="Visualizer", name="visualizer", vis_backends=[dict(type="LocalVisBackend")])
    runner = _runner("local", visualizer=local)
    assert not _logger_hook(runner).tensorboard
    runner.train()
    assert not (runner.log_dir / "tensorboard").exists() and (runner.log_dir / "scalars.jsonl").is_file()
    both = dict(type="Visualizer", vis_backends=[dict(type="LocalVisBackend"), dict(type="TensorboardVisBackend"),
                                                 dict(type="WandbVisBackend", init_kwargs=dict(project="p"))])
    for _ in range(2):
        assert _logger_hook(_runner("tb", visualizer=both)).tensorboard
    assert len(_warnings(caplog, "WandbVisBackend in visualizer.vis_backends has no effect")) == 1
    assert not _warnings(caplog, "LocalVisBackend in") and not _warnings(caplog, "TensorboardVisBackend in")
    # The logger hook's own setting wins over the visualizer's.
    explicit = _runner("x", visualizer=local, default_hooks=dict(checkpoint=None, logger=dict(tensorboard=True)))
    assert _logger_hook(explicit).tensorboard and _logger_hook(_runner("d")).tensorboard  # default: on


def test_top_level_vis_backends_as_mmengine_configs_write_them(tmp_path):
    vis_backends = [dict(type="LocalVisBackend")]
    cfg = dict(model=Regression(), work_dir=str(tmp_path / "w"), vis_backends=vis_backends,
               visualizer=dict(type="Visualizer", vis_backends=vis_backends, name="visualizer"))
    assert not _logger_hook(Runner.from_cfg(cfg)).tensorboard
    alone = {k: v for k, v in cfg.items() if k != "visualizer"}
    assert not _logger_hook(Runner.from_cfg(alone)).tensorboard  # vis_backends alone: the visualizer's
    assert _logger_hook(Runner.from_cfg({k: v for k, v in cfg.items() if "vis" not in k})).tensorboard


def test_default_scope_warns_once(caplog):
    _runner("a", default_scope="mmdet")
    _runner("b", default_scope="mmdet")
    [msg] = _warnings(caplog, "default_scope='mmdet' has no effect")
    assert "registry scopes" in msg


def test_mmdetection_2s_fp16_key_loads_and_says_it_changes_nothing(tmp_path, caplog):
    """MMDetection's DINO Swin-L config sets ``fp16 = dict(loss_scale=512.)``, which MMEngine's Runner never reads:
    the config loads, trains in fp32 as it would there, and one warning says how to ask for mixed precision."""
    cfg = dict(model=Regression(), work_dir=str(tmp_path / "w"), fp16=dict(loss_scale=512.0))
    Runner.from_cfg(cfg)
    Runner.from_cfg({**cfg, "work_dir": str(tmp_path / "v")})
    [msg] = _warnings(caplog, "fp16={'loss_scale': 512.0} has no effect in memfit")
    assert "optim_wrapper=dict(type='AmpOptimWrapper'" in msg
