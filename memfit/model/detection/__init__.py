"""Detection models: timm backbones, torchvision detectors and a DINO-class detector under the BaseModel contract,
with MMDetection's data-sample fields as plain dicts (docs/detection.md)."""

from memfit.model.detection import backbones, necks, torchvision_detectors  # noqa: F401  (registers the models)
from memfit.model.detection.data_preprocessor import DetDataPreprocessor, padding_masks
from memfit.model.detection.dino import DINO

__all__ = ["DINO", "DetDataPreprocessor", "padding_masks"]
