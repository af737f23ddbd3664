"""Activation offload: exact on CPU, saves device memory on CUDA, never doubles up."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import timm
import torch
import torchvision
from torch import nn

from memfit.errors import ConfigError
from memfit.measure import MemoryTracker
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.memory.offload import apply_activation_offload


def resnet18_frozen_bn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model, torch.randn(2, 3, 32, 32)


def vit() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, drop_path_rate=0.0,
                              num_classes=10)
    return model, torch.randn(2, 3, 32, 32)


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = nn.functional.cross_entropy(model(x), torch.arange(x.shape[0], device=x.device) % 10)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "build, names",
    [(resnet18_frozen_bn, ["layer1", "layer3"]), (resnet18_frozen_bn, ["conv1"]), (vit, ["blocks"])],
)
def test_exact_on_cpu(build: Callable[[], tuple[nn.Module, torch.Tensor]], names: list[str]) -> None:
    """Saved tensors come back as bit-identical copies, so loss and gradients are unchanged."""
    model, x = build()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), x)
    keys = list(model.state_dict())
    assert apply_activation_offload(model, names) == names
    loss, grads = loss_and_grads(model, x)
    assert list(model.state_dict()) == keys
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_saved_tensors_go_through_save_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors saved inside an offloaded module (and only those) pass through save_on_cpu's pack hook."""
    packed: list[torch.Size] = []
    pins: list[bool] = []

    class Recording(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory=pin_memory)
            pins.append(pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32))
    apply_activation_offload(model, ["2"])
    model(torch.randn(4, 8)).sum().backward()
    assert pins == [False]  # pinned host buffers only for activations on a GPU (these are on the CPU)
    assert torch.Size([4, 16]) in packed  # the input of layer 2, saved for its weight gradient
    assert torch.Size([4, 8]) not in packed  # layer 0 is not offloaded
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert len(pins) == 1  # no hooks at all without autograd


def test_never_twice() -> None:
    model, x = resnet18_frozen_bn()
    assert apply_activation_offload(model, ["layer1"]) == ["layer1"]
    assert apply_activation_offload(model, ["layer1", "layer1.0"]) == []  # already offloaded / inside
    # A checkpointed module saves almost nothing: offloading it, or checkpointing an offloaded one,
    # is refused.
    assert apply_activation_checkpointing(model, ["layer2"]) == ["layer2"]
    assert apply_activation_offload(model, ["layer2.1"]) == []
    assert apply_activation_checkpointing(model, ["layer1.1"]) == []
    assert apply_activation_offload(model, ["layer3"]) == ["layer3"]
    loss_and_grads(model, x)


def test_unknown_names_are_config_errors() -> None:
    model, _ = resnet18_frozen_bn()
    msg = r"activation_offload: model has no module 'layr1': did you mean 'layer1'"
    with pytest.raises(ConfigError, match=msg):
        apply_activation_offload(model, ["layr1"])
    with pytest.raises(ConfigError, match="must be a list of module names"):
        apply_activation_offload(model, {"names": ["layer1"]})  # type: ignore[arg-type]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="on CPU activations are already in host memory: the saving exists only on a GPU",
)
def test_saves_device_memory_on_cuda() -> None:
    def peak(offload: bool) -> int:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).cuda()
        x = torch.randn(32, 3, 128, 128, device="cuda")
        if offload:
            apply_activation_offload(model, ["layer1", "layer2", "layer3", "layer4"])
        with MemoryTracker(model) as t:
            loss_and_grads(model, x)
        return t.peak_bytes

    assert peak(True) < 0.8 * peak(False)
