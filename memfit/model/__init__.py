"""Models: the BaseModel contract and adapters for timm/torchvision models."""

from memfit.model.base import BaseDataPreprocessor, BaseModel, move_to
from memfit.model.classifier import ImageClassifier, TimmClassifier
from memfit.model.detection import DetDataPreprocessor  # registers the detection models too
from memfit.model.vissl import VisslModel
from memfit.registry import MODELS

MODELS.register(BaseDataPreprocessor)

__all__ = [
    "BaseModel", "BaseDataPreprocessor", "DetDataPreprocessor", "ImageClassifier", "TimmClassifier", "VisslModel",
    "move_to",
]
