"""Bad inputs raise the builtin exception type MMEngine raises for them, as memfit's one-line errors.

A wrongly typed value is a ConfigTypeError (a ConfigError, a ValueError and a TypeError), where MMEngine
raises TypeError; a bad value is a ConfigError (a ValueError, not a TypeError), where MMEngine raises
ValueError. So ``except TypeError`` / ``except ValueError`` written for MMEngine still catch them, and
``except ConfigError`` catches both. Line numbers are MMEngine's at commit 2543429 (mmengine/...).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.data.loader import build_dataloader
from memfit.errors import ConfigError, ConfigTypeError
from memfit.hooks import CheckInvalidLossHook, CheckpointHook, LoggerHook, MemoryMonitorHook
from memfit.hooks.base import get_priority
from memfit.optim import OptimWrapper
from memfit.optim.builder import DefaultOptimWrapperConstructor, build_optim_wrapper
from memfit.registry import HOOKS
from memfit.runner import Runner

SHAPES = dict(type="ShapesDataset", num_samples=4, image_size=8, num_classes=2)


def _sgd():
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def _loader(**cfg):
    return build_dataloader(dict(dataset=SHAPES, **cfg), seed=0)


def _runner(tmp_path, **kw):
    return Runner(**{"model": nn.Linear(2, 2), "work_dir": str(tmp_path), **kw})


# (what builds the bad input, the builtin type MMEngine raises, memfit's one-line message, as it was)
CASES = [
    # hooks/logger_hook.py:89 TypeError('interval must be an integer'); :91 ValueError(... greater than 0)
    (lambda t: LoggerHook(interval="100"), TypeError, r"^interval='100': use an int >= 1"),
    (lambda t: LoggerHook(interval=0), ValueError, r"^interval=0: use an int >= 1"),
    # hooks/logger_hook.py:97 / :99
    (lambda t: LoggerHook(interval_exp_name="5"), TypeError, r"\.interval_exp_name='5': use an int >= 1"),
    (lambda t: LoggerHook(interval_exp_name=0), ValueError, r"\.interval_exp_name=0: use an int >= 1"),
    # hooks/logger_hook.py:94 (ignore_last), :105 (keep_local): TypeError('... must be a boolean')
    (lambda t: LoggerHook(ignore_last="yes"), TypeError, r"\.ignore_last='yes': use True or False"),
    (lambda t: LoggerHook(keep_local=1), TypeError, r"\.keep_local=1: use True or False"),
    # hooks/logger_hook.py:102 TypeError('out_dir must be a str or Path object')
    (lambda t: LoggerHook(out_dir=3), TypeError, r"\.out_dir=3: must be a str or Path"),
    # hooks/logger_hook.py:124 TypeError('out_suffix should be a string or a sequence of string')
    (lambda t: LoggerHook(out_suffix=3), TypeError, r"\.out_suffix=3: use a str or a tuple of str"),
    # hooks/logger_hook.py:108 and :119 ValueError (file_client_args without out_dir / with backend_args)
    (lambda t: LoggerHook(file_client_args=dict(backend="local")), ValueError, r"file_client_args is set without"),
    (lambda t: LoggerHook(out_dir=str(t), file_client_args={}, backend_args={}), ValueError, r"cannot both be set"),
    # hooks/hook.py:352 `n > 0` with a str interval: TypeError at the first save check
    (lambda t: CheckpointHook(interval="1"), TypeError, r"^interval='1': use an int >= 1, or -1"),
    (lambda t: CheckpointHook(interval=0), ValueError, r"^interval=0: use an int >= 1, or -1"),
    # hooks/checkpoint_hook.py:253 `save_begin < 0` with a str: TypeError; :254 ValueError for -1
    (lambda t: CheckpointHook(save_begin="1"), TypeError, r"\.save_begin='1': use an int >= 0"),
    (lambda t: CheckpointHook(save_begin=-1), ValueError, r"\.save_begin=-1: use an int >= 0"),
    # hooks/checkpoint_hook.py:241 TypeError('"published_keys" should be a str or a sequence of str')
    (lambda t: CheckpointHook(published_keys=3), TypeError, r"\.published_keys=3: use a str or a list of str"),
    (lambda t: CheckpointHook(published_keys=["a", "a"]), ValueError, r"remove the duplicate entries"),
    # runner/priority.py:61 TypeError('priority must be an integer or Priority enum value')
    (lambda t: get_priority(1.5), TypeError, r"^unknown hook priority 1\.5"),
    # memfit's own hooks, checked as MMEngine checks an interval
    (lambda t: CheckInvalidLossHook(interval="10"), TypeError, r"^interval='10': use an int >= 1"),
    (lambda t: MemoryMonitorHook(interval="5"), TypeError, r"interval must be a positive integer or None"),
    (lambda t: MemoryMonitorHook(interval=0), ValueError, r"interval must be a positive integer or None"),
    # registry/build_functions.py:121 `obj_cls(**args)`: Python's TypeError for an unexpected or a missing
    # keyword argument
    (lambda t: HOOKS.build(dict(type="LoggerHook", intervall=5)), TypeError, r"unknown key 'intervall'"),
    (lambda t: _runner(t, custom_hooks=[dict(type="LoggerHook", interval=[1])]), TypeError,
     r"^custom_hooks\[0\].*interval=\[1\]: use an int >= 1"),
    # runner/runner.py:839 TypeError('model should be a nn.Module object or dict')
    (lambda t: _runner(t, model=3), TypeError, r"^model must be an nn\.Module or a config dict, got int"),
    # runner/runner.py:1869 TypeError('hook should be an instance of Hook or dict')
    (lambda t: _runner(t, custom_hooks=[object()]), TypeError, r"a hook must subclass memfit\.hooks\.Hook"),
    # runner/runner.py:1510 TypeError('train_loop should be a Loop object or dict')
    (lambda t: _runner(t, train_cfg="epochs"), TypeError, r"^train_cfg must be a dict, got str"),
    # runner/loops.py:103 `epoch % self.val_interval` with a str: TypeError at the first epoch
    (lambda t: _runner(t, train_cfg=dict(max_epochs=1, val_interval="1")), TypeError,
     r"^train_cfg\.val_interval must be int, got str"),
    # runner/runner.py:1133 TypeError('optimizer wrapper should be an OptimWrapper object or dict')
    (lambda t: build_optim_wrapper(nn.Linear(2, 2), 3), TypeError, r"^optim_wrapper must be a dict or an OptimWrapper"),
    # optim/optimizer/optimizer_wrapper.py:122 `accumulative_counts > 0` with a str: TypeError
    (lambda t: OptimWrapper(_sgd(), accumulative_counts="2"), TypeError, r"accumulative_counts='2': use an int >= 1"),
    (lambda t: OptimWrapper(_sgd(), accumulative_counts=0), ValueError, r"accumulative_counts=0: use an int >= 1"),
    # optim/optimizer/default_constructor.py:122 and :136 TypeError
    (lambda t: DefaultOptimWrapperConstructor(3), TypeError, r"^optim_wrapper_cfg should be a dict, got int"),
    (lambda t: DefaultOptimWrapperConstructor(dict(optimizer=dict(type="SGD", lr=0.1)), 3), TypeError,
     r"^paramwise_cfg should be None or a dict, got int"),
    # optim/optimizer/default_constructor.py:141 TypeError('If specified, custom_keys must be a dict')
    (lambda t: build_optim_wrapper(nn.Linear(2, 2), dict(optimizer=dict(type="SGD", lr=0.1),
                                                         paramwise_cfg=dict(custom_keys=["head"]))),
     TypeError, r"^paramwise_cfg\.custom_keys: use a dict"),
    # torch's SGD compares `lr < 0.0`: a str lr is a TypeError, a negative one a ValueError
    (lambda t: build_optim_wrapper(nn.Linear(2, 2), dict(optimizer=dict(type="SGD", lr="1e-3"))), TypeError,
     r"^optim_wrapper\.optimizer\.lr='1e-3' is a string"),
    (lambda t: build_optim_wrapper(nn.Linear(2, 2), dict(optimizer=dict(type="SGD", lr=-1.0))), ValueError,
     r"^optim_wrapper\.optimizer\.lr=-1\.0: invalid learning rate: -1\.0 \(SGD\)"),
    # runner/runner.py:1473 TypeError('collate_fn should be a dict or callable object')
    (lambda t: _loader(batch_size=2, collate_fn=3), TypeError,
     r"\.collate_fn: expected a name, dict\(type=\.\.\.\) or a callable, got 3"),
    # torch's BatchSampler raises ValueError for a batch size that is no positive int (MMEngine passes it on):
    # ConfigTypeError for a str is both, so MMEngine's `except ValueError` still catches it.
    (lambda t: _loader(batch_size="2"), TypeError, r"batch_size='2' must be a positive int"),
    (lambda t: _loader(batch_size=0), ValueError, r"batch_size=0 must be a positive int"),
]


def _caught_by(build, tmp_path) -> set[str]:
    """Which of MMEngine users' except clauses catch what ``build`` raises."""
    caught = set()
    for kind in (TypeError, ValueError, ConfigError):
        try:
            try:
                build(tmp_path)
            except kind:
                caught.add(kind.__name__)
        except Exception:  # not caught by ``except kind``
            pass
    return caught


@pytest.mark.parametrize("build, mmengine_type, message", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_raises_mmengines_builtin_type_with_the_one_line_message(build, mmengine_type, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as exc:
        build(tmp_path)
    assert "\n" not in str(exc.value)
    if mmengine_type is TypeError:
        assert type(exc.value) is ConfigTypeError
        assert _caught_by(build, tmp_path) == {"TypeError", "ValueError", "ConfigError"}
    else:
        assert type(exc.value) is ConfigError
        assert _caught_by(build, tmp_path) == {"ValueError", "ConfigError"}
