"""init_cfg: Pretrained loads a local file before training (prefix, non-strict); the torch.nn.init
types set weights of the named layer classes; mistakes are one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.hooks import Hook
from memfit.model import BaseModel
from memfit.model.init import init_model_weights, init_weights


class Net(BaseModel):
    def __init__(self, init_cfg=None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, y=None, mode="tensor"):
        out = self.head(self.norm(self.backbone(x)))
        return {"loss": nn.functional.cross_entropy(out, y)} if mode == "loss" else out


def test_pretrained_with_prefix_loads_only_that_part(tmp_path):
    source = Net()
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in source.backbone.state_dict().items()}},
               tmp_path / "bb.pth")
    target = Net()
    head_before = target.head.weight.clone()
    init_weights(target.backbone, dict(type="Pretrained", checkpoint=str(tmp_path / "bb.pth"), prefix="backbone"))
    assert all(torch.equal(a, b) for a, b in zip(target.backbone.parameters(), source.backbone.parameters()))
    assert torch.equal(target.head.weight, head_before)


def test_layer_inits_touch_only_the_named_classes():
    net = Net()
    init_weights(net, [dict(type="Constant", val=0.5, bias=0.1, layer="Linear"),
                       dict(type="Normal", std=0.01, layer=["LayerNorm"])])
    assert torch.all(net.head.weight == 0.5) and torch.all(net.backbone[0].bias == 0.1)
    assert not torch.all(net.norm.weight == 1.0) and net.norm.weight.std() < 0.05
    init_weights(net, dict(type="Kaiming", layer="Linear", distribution="uniform"))
    assert not torch.all(net.head.weight == 0.5)


@pytest.mark.parametrize("cfg, match", [
    (dict(type="Normall"), "did you mean 'Normal'"),
    (dict(type="Normal", sdt=1.0), "takes no 'sdt'"),
    (dict(type="Pretrained"), "needs checkpoint="),
    (dict(type="Pretrained", checkpoint="missing.pth"), "missing.pth"),
    ("Pretrained", "use dict\\(type='Pretrained'"),
])
def test_bad_init_cfg_is_one_line(cfg, match):
    with pytest.raises((ConfigError, Exception), match=match) as err:
        init_model_weights(Net(init_cfg=cfg))
    assert "\n" not in str(err.value)


def test_runner_applies_init_cfg_before_training(tmp_path):
    from memfit import Runner

    source = Net()
    torch.save(source.state_dict(), tmp_path / "full.pth")
    seen = {}

    class Spy(Hook):
        def before_train(self, runner):
            seen["head"] = runner.model.head.weight.detach().clone()

    data = [(torch.randn(4), torch.tensor(1)) for _ in range(8)]
    runner = Runner(model=Net(init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / "full.pth"))),
                    work_dir=str(tmp_path / "w"), train_dataloader=dict(batch_size=4, dataset=data),
                    train_cfg=dict(by_epoch=True, max_epochs=1), default_hooks=dict(checkpoint=None),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)), custom_hooks=[Spy()])
    runner.train()
    assert torch.equal(seen["head"].cpu(), source.head.weight)  # the runner may have moved it to a GPU
