"""Several optimizers (OptimWrapperDict) and custom optimizer-wrapper constructors, as MMEngine's."""

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.optim import DefaultOptimWrapperConstructor, OptimWrapper, OptimWrapperDict, build_optim_wrapper
from memfit.registry import OPTIM_WRAPPER_CONSTRUCTORS


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        self.discriminator = nn.Linear(2, 1)


def test_dict_of_configs_builds_one_wrapper_per_submodule():
    model = GAN()
    wrappers = build_optim_wrapper(model, dict(
        generator=dict(optimizer=dict(type="Adam", lr=1e-3, betas=(0.5, 0.999)),
                       paramwise_cfg=dict(norm_decay_mult=0.0)),
        discriminator=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
    ))
    assert isinstance(wrappers, OptimWrapperDict) and list(wrappers.keys()) == ["generator", "discriminator"]
    gen, disc = wrappers["generator"], wrappers["discriminator"]
    assert {id(p) for g in gen.optimizer.param_groups for p in g["params"]} == {id(p) for p in
                                                                                model.generator.parameters()}
    assert [p for g in disc.optimizer.param_groups for p in g["params"]] == list(model.discriminator.parameters())
    # MMEngine's names: '<name>.lr' (and '<name>.base_lr' for a member with several groups).
    lrs = wrappers.get_lr()
    assert lrs["generator.base_lr"] == [1e-3] and lrs["discriminator.lr"] == [0.1]
    # Under paramwise_cfg one entry per parameter (MMEngine's DefaultOptimWrapperConstructor: a group each).
    assert wrappers.get_momentum() == {"generator.momentum": [0.5] * len(list(model.generator.parameters())),
                                       "discriminator.momentum": [0.9]}
    assert "generator" in wrappers and len(wrappers) == 2


def test_members_step_separately_and_state_round_trips():
    model = GAN()
    cfg = dict(generator=dict(optimizer=dict(type="SGD", lr=0.1)),
               discriminator=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)))
    wrappers = build_optim_wrapper(model, cfg)
    before = model.generator[0].weight.detach().clone()
    x = torch.randn(4, 2)
    with wrappers["discriminator"].optim_context(model.discriminator):
        d_loss = model.discriminator(model.generator(x).detach()).mean()
    wrappers["discriminator"].update_params(d_loss)
    assert torch.equal(model.generator[0].weight, before)  # only the discriminator stepped
    with pytest.raises(NotImplementedError, match="each optimizer wrapper"):
        wrappers.update_params(d_loss)
    state = wrappers.state_dict()
    assert set(state) == {"generator", "discriminator"} and "param_groups" in state["discriminator"]
    fresh = build_optim_wrapper(GAN(), cfg)
    fresh.load_state_dict(state)
    assert len(fresh["discriminator"].optimizer.state) == 2  # momentum buffers of weight and bias
    with pytest.raises(KeyError, match="has optimizer 'critic'"):
        fresh.load_state_dict({"critic": state["generator"]})


def test_dict_of_live_wrappers_and_errors():
    model = GAN()
    live = dict(generator=OptimWrapper(torch.optim.SGD(model.generator.parameters(), lr=0.1)),
                discriminator=OptimWrapper(torch.optim.SGD(model.discriminator.parameters(), lr=0.2)))
    wrappers = build_optim_wrapper(model, live)
    assert wrappers["discriminator"] is live["discriminator"]
    with pytest.raises(ConfigError, match="optim_wrapper.critic: the model has no submodule 'critic'"):
        build_optim_wrapper(model, dict(critic=dict(optimizer=dict(type="SGD", lr=0.1))))
    with pytest.raises(TypeError, match="OptimWrapperDict takes OptimWrapper instances"):
        OptimWrapperDict(generator=torch.optim.SGD(model.parameters(), lr=0.1))


def test_custom_constructor_from_config():
    @OPTIM_WRAPPER_CONSTRUCTORS.register(name="HeadOnlyConstructor")
    class HeadOnly(DefaultOptimWrapperConstructor):
        """Optimizes the discriminator only, at 10x the configured lr."""

        def __call__(self, model):
            optimizer = torch.optim.SGD(model.discriminator.parameters(), lr=self.base_lr * 10)
            return OptimWrapper(optimizer, **{k: v for k, v in self.optim_wrapper_cfg.items() if k != "optimizer"})

    wrapper = build_optim_wrapper(GAN(), dict(constructor="HeadOnlyConstructor", accumulative_counts=2,
                                              optimizer=dict(type="SGD", lr=0.01)))
    assert wrapper.get_lr() == {"lr": [pytest.approx(0.1)]} and wrapper.accumulative_counts == 2
    with pytest.raises(ConfigError, match="optim_wrapper.constructor"):
        build_optim_wrapper(GAN(), dict(constructor="NoSuchConstructor", optimizer=dict(type="SGD", lr=0.1)))


def test_default_constructor_add_params_follows_paramwise_cfg():
    ctor = DefaultOptimWrapperConstructor(dict(optimizer=dict(type="SGD", lr=0.1, weight_decay=1e-4)),
                                          dict(norm_decay_mult=0.0))
    params = []
    ctor.add_params(params, GAN().generator)
    decays = sorted({g["weight_decay"] for g in params})
    assert decays == [0.0, 1e-4] and sum(len(g["params"]) for g in params) == 6


class TinyGAN(GAN):
    """A GAN-style model with MMEngine's custom train_step: each optimizer stepped by hand."""

    def __init__(self):
        super().__init__()
        from memfit.model import BaseDataPreprocessor

        self.data_preprocessor = BaseDataPreprocessor()

    def train_step(self, data, optim_wrapper):
        x = torch.stack([d[0] for d in data]) if isinstance(data, list) else data[0]
        d_opt, g_opt = optim_wrapper["discriminator"], optim_wrapper["generator"]
        with d_opt.optim_context(self.discriminator):
            d_loss = self.discriminator(self.generator(x).detach()).mean() - self.discriminator(x).mean()
        d_opt.update_params(d_loss)
        with g_opt.optim_context(self.generator):
            g_loss = -self.discriminator(self.generator(x)).mean()
        g_opt.update_params(g_loss)
        self.discriminator.zero_grad(set_to_none=True)  # the generator's backward left gradients there
        return {"loss_d": d_loss.detach(), "loss_g": g_loss.detach()}

    def val_step(self, data):
        return []


def _gan_runner(work_dir, **kw):
    from memfit.runner import Runner

    torch.manual_seed(0)
    data = [(torch.randn(2),) for _ in range(8)]
    return Runner(
        model=TinyGAN(), work_dir=str(work_dir), randomness=dict(seed=0),
        train_dataloader=dict(dataset=data, batch_size=4, sampler=dict(type="DefaultSampler", shuffle=False)),
        train_cfg=dict(by_epoch=True, max_epochs=4),
        optim_wrapper=dict(generator=dict(optimizer=dict(type="Adam", lr=1e-3)),
                           discriminator=dict(optimizer=dict(type="SGD", lr=1e-2, momentum=0.9))),
        param_scheduler=dict(generator=[dict(type="LinearLR", start_factor=0.5, end=3)],
                             discriminator=[dict(type="StepLR", step_size=2, gamma=0.5)]),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)), **kw)


def test_gan_runner_trains_logs_and_resumes_exactly(tmp_path):
    full = _gan_runner(tmp_path / "full")
    full.train()
    lrs = full.optim_wrapper.get_lr()
    # LinearLR(0.5, end=3): 0.5, 0.75, 1.0 x lr over epochs 0-2, then held. StepLR(2, 0.5) with the
    # default end=max_epochs=4: halved at epoch 2; step 4 is outside [0, 4), so it stays.
    assert lrs["generator.lr"] == [pytest.approx(1e-3)] and lrs["discriminator.lr"] == [pytest.approx(5e-3)]
    log = next((tmp_path / "full").glob("*/*.log")).read_text()
    assert "generator.lr: " in log and "discriminator.lr: " in log
    resumed = _gan_runner(tmp_path / "part", resume=str(tmp_path / "full" / "epoch_2.pth"))
    resumed.train()
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


def test_several_optimizers_are_refused_with_zero1():
    from memfit.connector import setup
    from memfit.strategies import DDPStrategy

    strategy = DDPStrategy(zero=True)
    with pytest.raises(ConfigError, match="several optimizers"):
        setup(GAN(), strategy, dict(generator=dict(optimizer=dict(type="SGD", lr=0.1)),
                                    discriminator=dict(optimizer=dict(type="SGD", lr=0.1))))
