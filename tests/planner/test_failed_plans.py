"""A plan whose fake step fails is left out with the reason; the others are still predicted."""

import torch
from torch import nn

from memfit.model import BaseModel
from memfit.planner.devices import this_cpu
from memfit.planner.predict import predict
from memfit.planner.report import summary


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(768, 256), nn.ReLU(inplace=True), nn.Linear(256, 768)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))  # ReLU overwrites fc1's output, which SAC saves


class _Net(BaseModel):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, img=None, mode="tensor", **_):
        x = img.flatten(1).float()  # 3 x 16 x 16
        for block in self.blocks:
            x = block(x)
        return {"loss": x.square().mean()} if mode == "loss" else x


def test_selective_checkpointing_over_an_in_place_op_is_left_out_with_the_reason(tmp_path):
    with torch.device("meta"):
        model = _Net()
    cfg = dict(model=model, work_dir=str(tmp_path),
               optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
               train_dataloader=dict(batch_size=2, num_workers=0, dataset=dict(
                   type="ShapesDataset", image_size=16, num_classes=2, num_samples=4)))
    pred = predict(cfg, device=this_cpu(), verify=False)
    names = [r.plan.name for r in pred.results]
    assert not any("ac:selective" in n for n in names)
    assert any("ac:blocks" in n for n in names) and any("ac:" not in n for n in names)
    assert len(pred.notes) == 1 and "ac:selective" in pred.notes[0] and "mutated" in pred.notes[0]
    assert "note: " in summary(pred)
