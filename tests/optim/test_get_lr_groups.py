"""get_lr()/get_momentum() report one entry per param group MMEngine's constructor makes, though memfit's
optimizer merges the groups with equal options.

MMEngine's ``DefaultOptimWrapperConstructor.add_params`` (mmengine/optim/optimizer/default_constructor.py)
makes one group per trainable parameter under ``paramwise_cfg``, visiting each module's own parameters and
then its children (``named_modules()`` order), skipping ``requires_grad=False`` ones; a ``custom_keys``
match sets ``lr = base_lr * lr_mult`` and copies the key's other options (``momentum``) into the group.
``OptimWrapper.get_lr()`` is ``{'base_lr': [...], 'lr': [g['lr'] for g in param_groups]}``.
"""

import pytest
import torch
from torch import nn

from memfit.optim.builder import build_optim_wrapper
from memfit.optim.scheduler import MultiStepLR

LR, MOMENTUM = 0.1, 0.9


class Net(nn.Module):
    """The head sits between modules of the default options, so a merged group is not a contiguous run."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.fc.bias.requires_grad_(False)  # frozen: no group in MMEngine either


def _wrapper():
    model = Net()
    cfg = dict(optimizer=dict(type="SGD", lr=LR, momentum=MOMENTUM, weight_decay=1e-4),
               paramwise_cfg=dict(norm_decay_mult=0.0, custom_keys={"head": dict(lr_mult=10, momentum=0.5)}))
    return build_optim_wrapper(model, cfg)


# MMEngine's groups in its order: conv.weight, conv.bias, head.weight, head.bias, norm.weight, norm.bias,
# fc.weight (fc.bias is frozen); lr = LR x lr_mult (10 for the 'head' key, 1 otherwise).
LR_MULTS = [1, 1, 10, 10, 1, 1, 1]
MOMENTA = [MOMENTUM, MOMENTUM, 0.5, 0.5, MOMENTUM, MOMENTUM, MOMENTUM]


def test_get_lr_has_one_entry_per_original_group_as_the_scheduler_steps():
    wrapper = _wrapper()
    # The merge stays: default options, the head, the zero-decay norm.
    assert len(wrapper.optimizer.param_groups) == 3 < len(LR_MULTS)
    scheduler = MultiStepLR(wrapper, milestones=[2, 4], gamma=0.1, by_epoch=False)
    for step in range(6):
        # MultiStepParamScheduler: value = base x gamma ** (milestones reached by the step count).
        factor = 0.1 ** sum(step >= m for m in (2, 4))
        lrs = wrapper.get_lr()
        assert lrs["lr"] == pytest.approx([LR * m * factor for m in LR_MULTS], rel=1e-12)
        assert lrs["base_lr"] == pytest.approx([LR * factor], rel=1e-12)  # the optimizer's default, scheduled too
        # LoggerHook logs each entry's first value: the first merged group holds the first parameter.
        assert lrs["lr"][0] == wrapper.optimizer.param_groups[0]["lr"]
        assert wrapper.get_momentum() == {"momentum": MOMENTA}
        scheduler.step()


def test_without_paramwise_cfg_get_lr_is_the_optimizers_groups():
    model = Net()
    wrapper = build_optim_wrapper(model, dict(optimizer=dict(type="SGD", lr=LR, momentum=MOMENTUM)))
    assert wrapper.original_groups is None
    assert wrapper.get_lr() == {"lr": [LR]} and wrapper.get_momentum() == {"momentum": [MOMENTUM]}


def test_a_live_optimizer_is_reported_as_built():
    model = Net()
    groups = [{"params": [model.head.weight], "lr": 1.0}, {"params": [model.conv.weight]}]
    wrapper = build_optim_wrapper(model, dict(optimizer=torch.optim.SGD(groups, lr=LR),
                                                paramwise_cfg=dict(norm_decay_mult=0.0)))
    assert wrapper.get_lr() == {"base_lr": [LR], "lr": [1.0, LR]}
