"""DINO (MMDetection's DETR-class detector) with separate checkpointing switches for backbone and encoder."""

from memfit.model.detection.dino.denoising import CdnQueryGenerator
from memfit.model.detection.dino.detector import DINO
from memfit.model.detection.dino.head import DINOHead
from memfit.model.detection.dino.matcher import HungarianAssigner
from memfit.model.detection.dino.transformer import (
    DeformableDecoderLayer,
    DeformableEncoder,
    DeformableEncoderLayer,
    DINODecoder,
)

__all__ = ["DINO", "DINOHead", "CdnQueryGenerator", "HungarianAssigner", "DeformableEncoder",
           "DeformableEncoderLayer", "DINODecoder", "DeformableDecoderLayer"]
