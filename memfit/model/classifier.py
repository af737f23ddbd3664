"""Image classifiers: any backbone module, or a timm model by name, under the BaseModel contract."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import type_or_value_error
from memfit.model.base import BaseModel
from memfit.registry import MODELS


@MODELS.register()
class ImageClassifier(BaseModel):
    """Wrap a module that maps images to logits: cross-entropy for 'loss', (scores, labels) for 'predict'.

    Batches are dicts with ``img`` and ``label`` (extra keys such as boxes are ignored) or
    ``(img, label)`` tuples.
    """

    def __init__(
        self,
        backbone: nn.Module | dict,
        label_smoothing: float = 0.0,
        data_preprocessor: nn.Module | dict | None = None,
        init_cfg: Any = None,
    ) -> None:
        if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool) \
                or not 0 <= label_smoothing <= 1:  # cross_entropy's own check comes only at the first step
            raise type_or_value_error(f"model.label_smoothing={label_smoothing!r}: use a number in [0, 1] (e.g. 0.1)",
                                      not isinstance(label_smoothing, (int, float)))
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.backbone = MODELS.build(backbone, key="model.backbone")
        self.label_smoothing = label_smoothing

    @property
    def num_classes(self) -> int | None:
        """How many logits the backbone outputs, where it says so (timm's ``num_classes``, a torchvision
        ``fc`` head), else None: compared with the dataset's classes before training."""
        declared = getattr(self.backbone, "num_classes", None)
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
            return declared
        head = getattr(self.backbone, "fc", None)
        return head.out_features if isinstance(head, nn.Linear) else None

    def forward(self, img: torch.Tensor, label: torch.Tensor | None = None, mode: str = "tensor", **_: Any) -> Any:
        logits = self.backbone(img)
        if mode == "tensor":
            return logits
        if mode == "loss":
            return {"loss": F.cross_entropy(logits.float(), label, label_smoothing=self.label_smoothing)}
        if mode == "predict":
            return logits.float().softmax(-1), label
        raise ValueError(f"unknown mode {mode!r}: use 'loss', 'predict' or 'tensor'")


@MODELS.register()
class TimmClassifier(ImageClassifier):
    """A timm classifier by name: ``dict(type='TimmClassifier', model_name='swin_large_patch4_window7_224')``.

    ``pretrained`` is False, True (timm's hub weights; needs network) or a local checkpoint path
    (loaded with ``weights_only=True`` through timm's ``pretrained_cfg_overlay``). Other keyword
    arguments go to ``timm.create_model`` (img_size, drop_path_rate, ...).
    """

    def __init__(
        self,
        model_name: str,
        num_classes: int = 1000,
        pretrained: bool | str = False,
        label_smoothing: float = 0.0,
        data_preprocessor: nn.Module | dict | None = None,
        init_cfg: Any = None,
        **timm_kwargs: Any,
    ) -> None:
        import timm

        from memfit.model.timm_args import check_timm_args

        check_timm_args(model_name, timm_kwargs, "model")
        if type(num_classes) is not int or num_classes < 1:  # timm's 0 (no head) would train on pooled features
            raise type_or_value_error(f"model.num_classes={num_classes!r}: use the number of classes, an int >= 1 (a "
                                      "headless timm model is TimmBackbone's)", type(num_classes) is not int)
        if isinstance(pretrained, str):
            timm_kwargs["pretrained_cfg_overlay"] = dict(file=pretrained)
            pretrained = True
        backbone = timm.create_model(model_name, pretrained=pretrained, num_classes=num_classes, **timm_kwargs)
        super().__init__(backbone, label_smoothing, data_preprocessor, init_cfg)
