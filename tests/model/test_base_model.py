"""BaseModel as MMEngine's: .to()/.cuda()/.cpu() move the data preprocessor and set its device;
the data_preprocessor argument is type-checked."""

import pytest
import torch
from torch import nn

from memfit.model import BaseDataPreprocessor, BaseModel


class Net(BaseModel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.fc = nn.Linear(2, 1)
        self.inner = nn.Sequential(BaseDataPreprocessor())  # a nested one follows too

    def forward(self, x, mode="tensor"):
        return self.fc(x)


def test_preprocessor_device_follows_the_model():
    model = Net()
    assert model.data_preprocessor.device == torch.device("cpu")  # MMEngine's default
    model.to("meta")
    assert model.data_preprocessor.device == torch.device("meta") == model.inner[0].device
    model.to(torch.float64)  # dtype only: the device is unchanged
    assert model.data_preprocessor.device == torch.device("meta")
    model = Net().to("meta").to_empty(device="cpu")  # to_empty: no data to copy off the meta device
    model.cpu()
    assert model.data_preprocessor.device == torch.device("cpu") == model.inner[0].device
    model.to(device="meta", dtype=torch.float32)
    assert model.inner[0].device == torch.device("meta")
    pre = BaseDataPreprocessor().to("meta")
    assert pre.device == torch.device("meta")
    assert pre({"x": torch.ones(1)})["x"].device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_moves_preprocessor():
    model = Net().cuda()
    assert model.data_preprocessor.device == torch.device("cuda", 0) or model.data_preprocessor.device.type == "cuda"
    assert model.data_preprocessor({"x": torch.ones(1)})["x"].is_cuda


def test_data_preprocessor_is_type_checked():
    with pytest.raises(TypeError, match="data_preprocessor should be a dict or an nn.Module instance, got str"):
        Net(data_preprocessor="BaseDataPreprocessor")
    assert isinstance(Net(data_preprocessor=dict(type="BaseDataPreprocessor")).data_preprocessor,
                      BaseDataPreprocessor)
