"""The seeds' snippets run on memfit with only the import lines changed."""

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader

from memfit.evaluator import BaseMetric
from memfit.model import BaseModel
from memfit.runner import Runner


def test_toy_model_accumulation_snippet():
    # mmengine_save_memory_en.md, "Gradient Accumulation", verbatim but for the imports (and a seed:
    # from an initialisation already near the optimum the |f - 1| term makes the loss oscillate).
    torch.manual_seed(0)
    train_dataset = [(torch.ones(1, 1), torch.ones(1, 1))] * 50
    train_dataloader = DataLoader(train_dataset, batch_size=2)

    class ToyModel(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, img, label, mode):
            feat = self.linear(img)
            loss1 = (feat - label).pow(2)
            loss2 = (feat - label).abs()
            return dict(loss1=loss1, loss2=loss2)

    runner = Runner(
        model=ToyModel(),
        work_dir='tmp_dir',
        train_dataloader=train_dataloader,
        train_cfg=dict(by_epoch=True, max_epochs=1),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01),
                           accumulative_counts=4)
    )
    from memfit.hooks import Hook

    steps = []

    class CountSteps(Hook):
        def before_train(self, runner):
            optimizer = runner.optim_wrapper.optimizer
            step = optimizer.step
            optimizer.step = lambda *a, **k: (steps.append(runner.iter), step(*a, **k))[1]

    runner.register_hook(CountSteps())
    runner.train()

    # 25 iterations, k=4: 6 full windows and a last one of 1 -> 7 optimizer steps, at the windows' ends.
    assert runner.iter == 25 and runner.optim_wrapper.inner_count == 25
    assert steps == [3, 7, 11, 15, 19, 23, 24]
    lines = [json.loads(x) for x in next(Path("tmp_dir").glob("*/scalars.jsonl")).read_text().splitlines()]
    assert [r["iter"] for r in lines] == [10, 20, 25]
    assert all("loss" in r and "lr" in r and "loss1" in r for r in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert (Path("tmp_dir") / "epoch_1.pth").is_file()


class MMResNet50(BaseModel):
    def __init__(self):
        super().__init__()
        self.resnet = torchvision.models.resnet50()

    def forward(self, imgs, labels, mode):
        x = self.resnet(imgs)
        if mode == 'loss':
            return {'loss': F.cross_entropy(x, labels)}
        elif mode == 'predict':
            return x, labels


class Accuracy(BaseMetric):
    def process(self, data_batch, data_samples):
        score, gt = data_samples
        self.results.append({
            'batch_size': len(gt),
            'correct': (score.argmax(dim=1) == gt).sum().cpu(),
        })

    def compute_metrics(self, results):
        total_correct = sum(item['correct'] for item in results)
        total_size = sum(item['batch_size'] for item in results)
        return dict(accuracy=100 * total_correct / total_size)


def test_resnet50_accuracy_snippet_with_activation_checkpointing():
    # mmengine_save_memory_en.md "Gradient Checkpointing" on the 15-minute tutorial's model;
    # CIFAR-10 (a download) swapped for torchvision's FakeData of the same shape.
    tf = torchvision.transforms.ToTensor()
    train_set = torchvision.datasets.FakeData(16, (3, 32, 32), 10, transform=tf, random_offset=0)
    valid_set = torchvision.datasets.FakeData(8, (3, 32, 32), 10, transform=tf, random_offset=100)
    train_dataloader = dict(batch_size=4, dataset=train_set, sampler=dict(type='DefaultSampler', shuffle=True),
                            collate_fn=dict(type='default_collate'))
    val_dataloader = dict(batch_size=4, dataset=valid_set, sampler=dict(type='DefaultSampler', shuffle=False),
                          collate_fn=dict(type='default_collate'))
    from torch.optim import SGD

    cfg = dict(
        activation_checkpointing=['resnet.layer1', 'resnet.layer2', 'resnet.layer3']
    )
    runner = Runner(
        model=MMResNet50(),
        work_dir='./work_dir',
        train_dataloader=train_dataloader,
        optim_wrapper=dict(optimizer=dict(type=SGD, lr=0.001, momentum=0.9)),
        train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1),
        val_dataloader=val_dataloader,
        val_cfg=dict(),
        val_evaluator=dict(type=Accuracy),
        launcher='none',
        cfg=cfg,
    )
    seen = []
    from memfit.hooks import Hook

    class Record(Hook):
        def after_val_epoch(self, runner, metrics=None):
            seen.append((runner.epoch, float(metrics["accuracy"])))

    runner.register_hook(Record())
    runner.train()
    assert [e for e, _ in seen] == [1, 2]  # validated after each of the 2 epochs
    # The seed's metric over the validation set equals the trained model's accuracy computed here.
    model, device = runner.model.eval(), runner.device
    with torch.no_grad():
        correct = sum(int((model(x.to(device), y.to(device), 'predict')[0].argmax(1) == y.to(device)).sum())
                      for x, y in DataLoader(valid_set, batch_size=4))
    assert seen[-1][1] == 100.0 * correct / len(valid_set)
    from memfit.memory.checkpointing import CheckpointedForward
    from memfit.memory.wrapping import wrapped_forward

    for name in ("layer1", "layer2", "layer3"):
        assert isinstance(wrapped_forward(getattr(runner.model.resnet, name)), CheckpointedForward)
    assert wrapped_forward(runner.model.resnet.layer4) is None
