"""Rank script: the seeds' FSDP snippets under torchrun, with only the imports changed.

1. mmengine_save_memory_en.md, "Large Model Training": ToyModel with
   ``cfg=dict(model_wrapper_cfg=dict(type='MMFullyShardedDataParallel', cpu_offload=True))``.
2. mmengine_training_big_models.md, FSDP: FlexibleRunner with ``FSDPStrategy(model_wrapper=
   dict(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=1e7)))`` and
   AmpOptimWrapper on MMResNet50 (CIFAR-10 swapped for FakeData; 7 validation images, so the
   distributed sampler pads one and the metric must drop it).
"""

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.utils.data import DataLoader

from memfit import FlexibleRunner, Runner, dist
from memfit.evaluator import BaseMetric
from memfit.model import BaseModel
from memfit.testing import write_result

# -- snippet 1 (verbatim but for the imports) ---------------------------------------------------
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
    optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
    cfg=dict(model_wrapper_cfg=dict(type='MMFullyShardedDataParallel', cpu_offload=True))
)
runner.train()
toy = dict(strategy=type(runner.strategy).__name__, cpu_offload=runner.strategy.cpu_offload,
           world=dist.get_world_size(), iters=runner.iter,
           weight_device=str(runner.model.linear.weight.to_local().device),
           local_numel=runner.model.linear.weight.to_local().numel())


# -- snippet 2 -----------------------------------------------------------------------------------
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
        return dict(accuracy=100 * total_correct / total_size, size=total_size)


tf = torchvision.transforms.ToTensor()
train_set = torchvision.datasets.FakeData(8, (3, 32, 32), 10, transform=tf, random_offset=0)
valid_set = torchvision.datasets.FakeData(7, (3, 32, 32), 10, transform=tf, random_offset=100)
train_dataloader = dict(batch_size=2, dataset=train_set, sampler=dict(type='DefaultSampler', shuffle=True),
                        collate_fn=dict(type='default_collate'))
val_dataloader = dict(batch_size=2, dataset=valid_set, sampler=dict(type='DefaultSampler', shuffle=False),
                      collate_fn=dict(type='default_collate'))

size_based_auto_wrap_policy = partial(
    size_based_auto_wrap_policy, min_num_params=1e7)

# set `type='FSDPStrategy'` and configure other parameters
strategy = dict(
    type='FSDPStrategy',
    model_wrapper=dict(auto_wrap_policy=size_based_auto_wrap_policy))

# set `type='AmpOptimWrapper'` and configure other parameters
optim_wrapper = dict(
    type='AmpOptimWrapper', optimizer=dict(type='AdamW', lr=1e-3))

# construct FlexibleRunner
runner = FlexibleRunner(
    model=MMResNet50(),
    work_dir='./work_dirs',
    strategy=strategy,
    train_dataloader=train_dataloader,
    optim_wrapper=optim_wrapper,
    param_scheduler=dict(type='LinearLR'),
    train_cfg=dict(by_epoch=True, max_epochs=1, val_interval=1),
    val_dataloader=val_dataloader,
    val_cfg=dict(),
    val_evaluator=dict(type=Accuracy))

# start training
runner.train()

# The metric over 7 images at world size 2 against the gathered model evaluated in one process.
metrics = runner.val()
plain = MMResNet50()
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

plain.load_state_dict(get_model_state_dict(runner.model, options=StateDictOptions(full_state_dict=True)))
plain.eval()
# Each rank evaluates, in the batches it saw (rank r: positions r, r+2, ... of 8, position 7 wrapping
# to sample 0 as padding), with its own BatchNorm statistics (FSDP does not synchronise buffers: each
# rank's running stats saw its own batches), so the logits are bit-identical to the rank's and no
# near-tie can flip; the counts are summed over the ranks.
correct = 0
with torch.no_grad():
    positions = list(range(dist.get_rank(), 8, 2))
    for batch in (positions[:2], positions[2:]):
        idx = [p % len(valid_set) for p in batch]
        imgs = torch.stack([valid_set[i][0] for i in idx])
        labels = torch.tensor([valid_set[i][1] for i in idx])
        hits = plain(imgs, labels, 'predict')[0].argmax(1) == labels
        correct += sum(int(h) for p, h in zip(batch, hits) if p < len(valid_set))
expected = 100.0 * sum(dist.all_gather_object(correct)) / len(valid_set)
fsdp = dict(units=runner.strategy.units, accuracy=float(metrics['accuracy']), size=int(metrics['size']),
            expected_accuracy=expected, precision=runner.optim_wrapper.precision.name)

# -- snippet 1 again, as a FlexibleRunner with no strategy and no launcher under torchrun ---------
# MMEngine infers the launcher from the environment and trains data parallel.
runner = FlexibleRunner(model=ToyModel(), work_dir='tmp_dir_ddp',
                        train_dataloader=DataLoader(train_dataset, batch_size=2),
                        train_cfg=dict(by_epoch=True, max_epochs=1),
                        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)))
runner.train()
weights = [dist.all_gather_object(float(p.detach().sum())) for p in runner.model.parameters()]
inferred = dict(strategy=type(runner.strategy).__name__, launcher=runner.launcher, world=dist.get_world_size(),
                iters=runner.iter, same_on_ranks=all(w[0] == w[1] for w in weights))
write_result(dict(toy=toy, inferred=inferred, **fsdp))
