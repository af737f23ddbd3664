"""Detection models: timm backbones, torchvision detectors and a DINO-class detector under the BaseModel contract,
with MMDetection's data-sample fields as plain dicts (docs/detection.md)."""

from memfit.model.detection import backbones, torchvision_detectors  # noqa: F401  (registers the models)
from memfit.model.detection.data_preprocessor import DetDataPreprocessor, padding_masks

__all__ = ["DetDataPreprocessor", "padding_masks"]
