"""Several optimizers under DDPStrategy: one DDP per submodule (MMEngine's MMSeparateDistributedDataParallel).

A GAN-like model whose custom train_step steps a generator and a discriminator (accumulative_counts=2) with
their own losses, on 2 gloo processes (scripts/gan_separate.py), trains the weights of the same training in
one process on the whole batch; strategies that cannot run several optimizers refuse in one line."""

from pathlib import Path

import pytest
import torch
from torch import nn

from memfit.connector import setup
from memfit.errors import ConfigError
from memfit.strategies import DDPStrategy, FSDPStrategy, strategy_from_model_wrapper
from memfit.testing import launch, max_diff, read_results

SCRIPTS = Path(__file__).parent / "scripts"
OPTIM = dict(generator=dict(optimizer=dict(type="SGD", lr=0.1)), discriminator=dict(optimizer=dict(type="SGD", lr=0.1)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gan_separate")
    proc = launch(SCRIPTS / "gan_separate.py", nproc=2, out_dir=out, timeout=240)
    return read_results(out, 2, proc)


@pytest.mark.parametrize("variant", ["ddp", "model_wrapper_cfg"])
def test_gan_on_two_ranks_matches_one_process(results, variant):
    r0, r1 = results
    got = r0[variant]
    assert got["separate"] == ["discriminator", "generator"]  # each submodule its own DDP
    # SGD on the mean of two half-batch gradients vs the whole batch's: only the summation order differs
    # (fp32, weights of order 1: ~1e-8 measured), so 1e-6.
    assert max_diff(got["params"], r0["reference"]["params"]) <= 1e-6
    assert got["params"] == r1[variant]["params"]  # both submodules were reduced: the ranks end identical
    # After the first iteration the discriminator's window (2) is open: its gradients stayed local, while the
    # generator's (window 1, inside the same iteration) were reduced and stepped to the same weights.
    assert got["synced_after_first"] == [False, True] == r1[variant]["synced_after_first"]
    # The user's keys, no ``module.`` prefix; the optimizer state keyed by optimizer name.
    assert got["state_keys"] == ["discriminator.bias", "discriminator.weight", "generator.bias", "generator.weight"]
    assert got["optim_keys"] == ["discriminator", "generator"]


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator, self.discriminator = nn.Linear(2, 2), nn.Linear(2, 1)


def test_model_wrapper_cfg_maps_to_separate_ddp_with_mmengine_defaults():
    s = strategy_from_model_wrapper(dict(type="MMSeparateDistributedDataParallel", find_unused_parameters=True))
    assert isinstance(s, DDPStrategy) and s.separate and s.ddp_kwargs["find_unused_parameters"]
    # MMEngine's MMSeparateDistributedDataParallel defaults broadcast_buffers to False (DDP's to True).
    assert not s.ddp_kwargs.get("forward_sync_buffers", s.ddp_kwargs.get("broadcast_buffers"))


def test_separate_ddp_keeps_the_model_and_syncs_per_submodule():
    """In one process: the children are routed through their own DDP, the model is the user's, and
    optim_context(child) turns off the reduction of that child's DDP only."""
    model, wrapper = setup(GAN(), DDPStrategy(), OPTIM)
    strategy = wrapper.strategy
    assert strategy.separate and strategy.ddp is None and type(model) is GAN
    assert sorted(model.state_dict()) == ["discriminator.bias", "discriminator.weight", "generator.bias",
                                          "generator.weight"]
    gen_ddp, disc_ddp = strategy.separate_ddps["generator"], strategy.separate_ddps["discriminator"]
    with strategy.no_sync(model.generator, sync=False):
        assert not gen_ddp.require_backward_grad_sync and disc_ddp.require_backward_grad_sync
    with strategy.no_sync(model, sync=False):  # the whole model: every submodule's DDP, as MMEngine's
        assert not gen_ddp.require_backward_grad_sync and not disc_ddp.require_backward_grad_sync
    assert gen_ddp.require_backward_grad_sync and disc_ddp.require_backward_grad_sync


@pytest.mark.parametrize("strategy, match", [
    (lambda: DDPStrategy(zero=True), "zero=True"),
    (lambda: DDPStrategy(separate=False), "separate=False"),
    (lambda: FSDPStrategy(), "not FSDPStrategy"),
], ids=["zero", "separate_false", "fsdp"])
def test_strategies_without_several_optimizers_refuse_in_one_line(strategy, match):
    with pytest.raises(ConfigError, match=match) as err:
        setup(GAN(), strategy(), OPTIM)
    assert "\n" not in str(err.value) and "several optimizers" in str(err.value)


def test_trainable_parameters_outside_submodules_are_refused():
    model = GAN()
    model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ConfigError, match=r"\['scale'\] outside its submodules"):
        setup(model, DDPStrategy(), OPTIM)
