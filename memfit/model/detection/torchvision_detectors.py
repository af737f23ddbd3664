"""torchvision's Faster R-CNN, RetinaNet and FCOS under the BaseModel contract, on timm backbones + FPN.

Each class *is* the torchvision detector (it subclasses it), so module names are torchvision's
(``backbone.body.layers`` for a Swin body, ``backbone.fpn``, ``rpn``, ``roi_heads``, ``head``) and
torchvision's own forward does the work. memfit adds only the glue: batches in MMDetection's
data-sample format (from DetDataPreprocessor, which already resized, normalised and padded, so
torchvision's transform neither resizes nor normalises), losses named ``loss_*``, and predictions
mapped back to original-image pixels.

torchvision's detectors sample anchors and proposals with data-dependent shapes (``nonzero``,
NMS), so they cannot run on fake tensors: the planner predicts the DINO detector, not these.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torchvision.models.detection as tvdet
from torch import nn
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

from memfit.errors import ConfigError, type_or_value_error
from memfit.model.base import BaseModel, build_data_preprocessor
from memfit.registry import MODELS


class FPNBackbone(nn.Module):
    """``body`` (a TimmBackbone) + torchvision's FeaturePyramidNetwork: what torchvision's detectors
    take as ``backbone`` (an ``out_channels`` attribute and an OrderedDict of maps)."""

    def __init__(self, body: nn.Module, out_channels: int = 256, extra: str = "pool") -> None:
        super().__init__()
        if not isinstance(out_channels, int) or isinstance(out_channels, bool) or out_channels < 1:
            raise type_or_value_error(f"model.out_channels={out_channels!r} must be a positive int (the feature "
                                      f"pyramid's channels, e.g. 256)", not isinstance(out_channels, int))
        self.body = body
        extra_blocks = LastLevelMaxPool() if extra == "pool" else LastLevelP6P7(out_channels, out_channels)
        self.fpn = FeaturePyramidNetwork(list(body.out_channels), out_channels, extra_blocks=extra_blocks)
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(self.body(x))))


class _PaddedBatch(GeneralizedRCNNTransform):
    """torchvision's transform minus resize and normalisation (DetDataPreprocessor did both); it still
    pads the images to one batch and records their sizes."""

    def resize(self, image: torch.Tensor, target: dict | None = None) -> tuple[torch.Tensor, dict | None]:
        return image, target

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        return image


class _TorchvisionDetector(BaseModel):
    """The BaseModel side of a torchvision detector; the concrete classes below put it first in the MRO."""

    _torchvision: type  # the torchvision class whose forward runs
    _background: int = 0  # Faster R-CNN's label 0 is the background: labels are shifted by 1

    def _setup(self, data_preprocessor: Any, init_cfg: Any, size_divisor: int, num_classes: int) -> None:
        # torchvision's __init__ ran nn.Module's; BaseModel.__init__ would run it again through the MRO.
        self.num_classes = num_classes  # MMDetection's count (no background): checked against the datasets' classes
        self.data_preprocessor = build_data_preprocessor(data_preprocessor)
        self.init_cfg = init_cfg
        self.transform = _PaddedBatch(1, 1, [0.0] * 3, [1.0] * 3, size_divisible=size_divisor)

    def forward(self, inputs: torch.Tensor, data_samples: list[dict] | None = None, mode: str = "tensor") -> Any:
        if mode == "tensor":
            return self.backbone(inputs)
        if mode not in ("loss", "predict"):
            raise ValueError(f"unknown mode {mode!r}: use 'loss', 'predict' or 'tensor'")
        if data_samples is None:
            raise ValueError(f"mode={mode!r} needs data_samples (from DetDataPreprocessor)")
        images = [img[:, : int(s["img_shape"][0]), : int(s["img_shape"][1])] for img, s in zip(inputs, data_samples)]
        if mode == "loss":
            targets = [{"boxes": s["gt_instances"]["bboxes"].float(),
                        "labels": s["gt_instances"]["labels"] + self._background} for s in data_samples]
            losses = self._torchvision.forward(self, images, targets)
            return {k if "loss" in k else f"loss_{k}": v for k, v in losses.items()}
        detections = self._torchvision.forward(self, images)
        return [_to_original(d, s, self._background) for d, s in zip(detections, data_samples)]


def _to_original(det: dict[str, torch.Tensor], sample: dict, shift: int) -> dict[str, Any]:
    """torchvision's detections (input pixels) as the contract's pred_instances in original pixels."""
    boxes = det["boxes"].detach().float()
    sw, sh = sample.get("scale_factor", (1.0, 1.0))
    boxes = boxes / boxes.new_tensor([sw, sh, sw, sh])
    h0, w0 = sample.get("ori_shape", sample["img_shape"])
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w0)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h0)
    return {"img_id": sample.get("img_id"), "ori_shape": (h0, w0),
            "pred_instances": {"bboxes": boxes, "scores": det["scores"].detach().float(),
                               "labels": det["labels"].detach() - shift}}


def _body(backbone: nn.Module | dict, out_indices: tuple[int, ...]) -> nn.Module:
    if isinstance(backbone, dict):
        backbone = {"type": "TimmBackbone", "out_indices": out_indices, **backbone}
    body = MODELS.build(backbone, key="model.backbone")
    if not hasattr(body, "out_channels"):
        raise ConfigError("model.backbone must return a list of NCHW maps and have out_channels "
                          "(use dict(type='TimmBackbone', model_name=...))")
    return body


def _anchors(sizes: Any, ratios: tuple[float, ...], per_octave: int) -> AnchorGenerator:
    """One anchor size per level (``per_octave`` scales within it, as RetinaNet's 2^(k/3))."""
    scales = tuple(tuple(int(s * 2 ** (k / per_octave)) for k in range(per_octave)) for s in sizes)
    return AnchorGenerator(scales, (tuple(ratios),) * len(scales))


@MODELS.register()
class FasterRCNN(_TorchvisionDetector, tvdet.FasterRCNN):
    """``dict(type='FasterRCNN', backbone=dict(model_name='swin_tiny_patch4_window7_224'), num_classes=80)``.

    Four backbone stages + a max-pooled level feed the RPN; ``anchor_sizes`` (one per level, default
    torchvision's 32..512) suit the data's object sizes. Other keys go to torchvision's FasterRCNN
    (``rpn_batch_size_per_image``, ``box_detections_per_img``, ...).
    """

    _torchvision = tvdet.FasterRCNN
    _background = 1

    def __init__(self, backbone: nn.Module | dict, num_classes: int, out_channels: int = 256,
                 anchor_sizes: tuple[int, ...] = (32, 64, 128, 256, 512), data_preprocessor: Any = None,
                 init_cfg: Any = None, size_divisor: int = 32, **kwargs: Any) -> None:
        fpn = FPNBackbone(_body(backbone, (0, 1, 2, 3)), out_channels, extra="pool")
        kwargs.setdefault("rpn_anchor_generator", _anchors(anchor_sizes, (0.5, 1.0, 2.0), 1))
        tvdet.FasterRCNN.__init__(self, fpn, num_classes=num_classes + 1, **kwargs)
        self._setup(data_preprocessor, init_cfg, size_divisor, num_classes)


@MODELS.register()
class RetinaNet(_TorchvisionDetector, tvdet.RetinaNet):
    """``dict(type='RetinaNet', backbone=dict(model_name=...), num_classes=80)``: stages 1-3 + P6/P7,
    three anchor scales per level from ``anchor_sizes``."""

    _torchvision = tvdet.RetinaNet

    def __init__(self, backbone: nn.Module | dict, num_classes: int, out_channels: int = 256,
                 anchor_sizes: tuple[int, ...] = (32, 64, 128, 256, 512), data_preprocessor: Any = None,
                 init_cfg: Any = None, size_divisor: int = 32, **kwargs: Any) -> None:
        fpn = FPNBackbone(_body(backbone, (1, 2, 3)), out_channels, extra="p6p7")
        kwargs.setdefault("anchor_generator", _anchors(anchor_sizes, (0.5, 1.0, 2.0), 3))
        tvdet.RetinaNet.__init__(self, fpn, num_classes=num_classes, **kwargs)
        self._setup(data_preprocessor, init_cfg, size_divisor, num_classes)


@MODELS.register()
class FCOS(_TorchvisionDetector, tvdet.FCOS):
    """``dict(type='FCOS', backbone=dict(model_name=...), num_classes=80)``: anchor-free, stages 1-3 +
    P6/P7; ``anchor_sizes`` are the levels' strides (torchvision's 8..128) setting their size ranges."""

    _torchvision = tvdet.FCOS

    def __init__(self, backbone: nn.Module | dict, num_classes: int, out_channels: int = 256,
                 anchor_sizes: tuple[int, ...] = (8, 16, 32, 64, 128), data_preprocessor: Any = None,
                 init_cfg: Any = None, size_divisor: int = 32, **kwargs: Any) -> None:
        fpn = FPNBackbone(_body(backbone, (1, 2, 3)), out_channels, extra="p6p7")
        kwargs.setdefault("anchor_generator", _anchors(anchor_sizes, (1.0,), 1))
        tvdet.FCOS.__init__(self, fpn, num_classes=num_classes, **kwargs)
        self._setup(data_preprocessor, init_cfg, size_divisor, num_classes)
