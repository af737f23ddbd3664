"""channels_last (memfit.speed.channels_last): exact on a conv net with BatchNorm, the weights and the batch
reach the forward in NHWC, the step's peak memory is not higher, nested batches, models without convolutions,
and the switch through the connector."""

from __future__ import annotations

import copy
import logging
from collections import namedtuple

import pytest
import torch
from torch import nn

from memfit.connector import setup
from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.model import BaseModel, DetDataPreprocessor
from memfit.speed import apply_channels_last, to_channels_last
from memfit.strategies import SingleDeviceStrategy

# CPU convolutions in NHWC sum in another order than in NCHW: equal to rounding.
TOL = dict(rtol=1e-4, atol=1e-5)
CL = torch.channels_last


class ConvNet(BaseModel):
    """uint8 images -> DetDataPreprocessor (normalised float batch) -> conv/BN/ReLU x2 -> linear head."""

    def __init__(self) -> None:
        super().__init__(data_preprocessor=DetDataPreprocessor(mean=[120.0, 110.0, 100.0], std=[60.0, 60.0, 60.0]))
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, data_samples: list, mode: str = "tensor") -> dict:
        labels = torch.tensor([s["label"] for s in data_samples])
        return {"loss": nn.functional.cross_entropy(self.head(self.body(inputs).mean((2, 3))), labels)}


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(inputs=[torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g) for _ in range(4)],
                data_samples=[dict(label=i % 2) for i in range(4)])


def _step(model: BaseModel) -> tuple[torch.Tensor, dict, dict, int]:
    with MemoryTracker(model) as tracker:
        data = model.data_preprocessor(_batch(), True)
        loss = model(**data, mode="loss")["loss"]
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, dict(model.named_buffers()), tracker.peak_bytes


def test_channels_last_is_exact_and_reaches_the_forward():
    plain = ConvNet()
    converted = copy.deepcopy(plain)
    assert apply_channels_last(converted)
    seen = []
    converted.body[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=CL)))

    want, got = _step(plain), _step(converted)
    torch.testing.assert_close(got[0], want[0], **TOL)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for name in want[2]:  # BatchNorm running statistics
        torch.testing.assert_close(got[2][name], want[2][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert seen == [True]  # the batch the preprocessor made reaches the first convolution in NHWC
    for conv in (converted.body[0], converted.body[3]):
        assert conv.weight.is_contiguous(memory_format=CL) and conv.weight.grad.is_contiguous(memory_format=CL)
    assert not plain.body[0].weight.is_contiguous(memory_format=CL)  # 3x3 weights: the layouts differ


def test_channels_last_peak_memory_is_not_higher():
    # The same bytes in another order; the preprocessor's NCHW batch is freed as soon as it is converted.
    plain = ConvNet()
    converted = copy.deepcopy(plain)
    apply_channels_last(converted)
    plain_peak, converted_peak = _step(plain)[3], _step(converted)[3]
    assert 0 < converted_peak <= plain_peak


def test_nested_batches_and_models_without_a_preprocessor():
    Pair = namedtuple("Pair", "image mask")
    x, ints, flat = torch.randn(2, 3, 4, 4), torch.zeros(2, 3, 4, 4, dtype=torch.long), torch.randn(3, 4, 4)
    out = to_channels_last({"a": [x, (x, ints)], "b": Pair(x, flat), "c": "text"})
    assert out["a"][0].is_contiguous(memory_format=CL) and out["a"][1][0].is_contiguous(memory_format=CL)
    assert out["a"][1][1] is ints and out["b"].mask is flat and out["c"] == "text"  # not float, not 4-D
    assert isinstance(out["b"], Pair) and torch.equal(out["b"].image, x)

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    seen = []
    net[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=CL)))
    apply_channels_last(net)
    net(x)
    assert seen == [True]  # converted by the model's own forward pre-hook


def test_a_model_without_convolutions_is_left_alone(caplog):
    caplog.set_level(logging.INFO, logger="memfit")
    model = nn.Sequential(nn.Linear(4, 4))
    assert not apply_channels_last(model)
    assert not model._forward_pre_hooks
    assert {r.getMessage() for r in caplog.records} == {
        "channels_last: Sequential has no 2-D convolutions; left as it is"}


def test_the_connector_applies_the_switch():
    model, _ = setup(ConvNet(), SingleDeviceStrategy(), None, dict(channels_last=True))
    assert model.body[0].weight.is_contiguous(memory_format=CL)
    with pytest.raises(ConfigError, match=r"^channels_last must be True or False, got 'yes'$"):
        setup(ConvNet(), SingleDeviceStrategy(), None, dict(channels_last="yes"))


def test_under_fsdp_the_batch_is_converted_and_the_weights_stay_contiguous():
    # fully_shard refuses non-contiguous parameters: the batch alone is NHWC and the convolutions follow it.
    from memfit.strategies import FSDPStrategy

    optim = dict(optimizer=dict(type="SGD", lr=0.1))
    plain, plain_wrapper = setup(ConvNet(), SingleDeviceStrategy(), optim)
    model, wrapper = setup(ConvNet(), FSDPStrategy(), optim, dict(channels_last=True))
    seen = []
    model.body[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=CL)))
    for m, w in ((plain, plain_wrapper), (model, wrapper)):
        w.initialize_count_status(m, 0, -1)
    want, got = plain.train_step(_batch(), plain_wrapper), model.train_step(_batch(), wrapper)
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    assert seen == [True] and model.body[0].weight.to_local().is_contiguous()
