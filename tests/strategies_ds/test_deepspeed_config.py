"""DeepSpeedStrategy's DeepSpeed keys are checked with DeepSpeed's own parser before anything is built:
a pydantic ValidationError becomes one line naming the key (no process group, no engine)."""

from __future__ import annotations

# `make venv` installs the extra: a broken install must fail these tests, not skip them.
import deepspeed  # noqa: F401
import pytest

from memfit.errors import ConfigError, ConfigTypeError
from memfit.runner import Runner
from memfit.strategies.deepspeed_config import check_deepspeed_config


@pytest.mark.parametrize("config, error, message", [
    (dict(zero_optimization=dict(stage=7)), ConfigError,
     "strategy.zero_optimization.stage=7: use 0, 1, 2 or 3 (DeepSpeed's DeepSpeedZeroConfig)"),
    (dict(zero_optimization=dict(stage=3, offload_optimizer=dict(device="gpu"))), ConfigError,
     "strategy.zero_optimization.offload_optimizer.device='gpu': use 'none', 'cpu' or 'nvme'"),
    (dict(zero_optimization=dict(stage=2, overlap_com=True)), ConfigError,
     "strategy.zero_optimization: unknown key 'overlap_com': did you mean 'overlap_comm'?"),
    (dict(zero_optimization=dict(stage=3, offload_param=dict(devic="cpu"))), ConfigError,
     "strategy.zero_optimization.offload_param: unknown key 'devic': did you mean 'device'?"),
    (dict(zero_optimization=dict(stage=2, reduce_bucket_size="big")), ConfigTypeError,
     "strategy.zero_optimization.reduce_bucket_size='big': input should be a valid integer"),
    (dict(fp16=dict(enabled=True, loss_scale=-1)), ConfigError,
     "strategy.fp16.loss_scale=-1: fp16.loss_scale must be >= 0"),
    (dict(zero_optimization=3), ConfigTypeError, "strategy.zero_optimization=3: got int: use a dict"),
    (dict(torch_autocast=dict(enabled=True, dtype="float8")), ConfigError,
     "strategy: DeepSpeed refuses the config: 'float8' is not a valid DtypeEnum"),
])
def test_deepspeed_refusals_name_the_key(config, error, message):
    with pytest.raises(error) as exc:
        check_deepspeed_config(config)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_the_seed_s_config_and_memfit_s_keys_pass():
    check_deepspeed_config(dict(
        fp16=dict(enabled=True, fp16_master_weights_and_grads=False, loss_scale=0, loss_scale_window=500,
                  hysteresis=2, min_loss_scale=1, initial_scale_power=15),
        zero_optimization=dict(stage=3, allgather_partitions=True, reduce_scatter=True, allgather_bucket_size=50000000,
                               reduce_bucket_size=50000000, overlap_comm=True, contiguous_gradients=True,
                               cpu_offload=False),
        amp=dict(enabled=True), train_micro_batch_size_per_gpu=8, steps_per_print=10**13))


def test_the_runner_refuses_it_before_building_anything(tmp_path):
    cfg = dict(model=dict(type="ImageClassifier", backbone=dict(type="resnet18", num_classes=2)), work_dir="w",
               strategy=dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=7)))
    with pytest.raises(ConfigError, match=r"^strategy\.zero_optimization\.stage=7: use 0, 1, 2 or 3"):
        Runner.from_cfg(cfg)
    assert not (tmp_path / "w").exists()  # refused before the work dir, the process group or the model
