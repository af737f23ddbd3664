"""Models: the BaseModel contract and adapters for timm/torchvision models."""

from memfit.model.base import BaseDataPreprocessor, BaseModel, move_to
from memfit.model.classifier import ImageClassifier, TimmClassifier
from memfit.model.detection import backbones as _backbones  # noqa: F401  (registers detection models)
from memfit.model.vissl import VisslModel
from memfit.registry import MODELS

MODELS.register(BaseDataPreprocessor)

__all__ = ["BaseModel", "BaseDataPreprocessor", "ImageClassifier", "TimmClassifier", "VisslModel", "move_to"]
