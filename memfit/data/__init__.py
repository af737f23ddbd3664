"""Data: the synthetic shapes and ImageFolder datasets, transform pipelines, the resumable
rank-sharded samplers, per-sample augmentation seeding and the dataloader builder.

Importing this package registers ``ShapesDataset``, ``ImageFolder`` and ``CocoDataset`` in DATASETS,
``DefaultSampler``/``InfiniteSampler`` in DATA_SAMPLERS and MMDetection's transforms in DET_TRANSFORMS.
"""

from memfit.data import det_resize  # noqa: F401 - registers Resize, RandomChoiceResize, RandomResize, Pad
from memfit.data.batch_sampler import AspectRatioBatchSampler
from memfit.data.coco import CocoDataset
from memfit.data.image_folder import ImageFolder
from memfit.data.loader import adapt_dataloader, build_collate_fn, build_dataloader, build_sampler
from memfit.data.sampler import DefaultSampler, FeistelPermutation, InfiniteSampler, SampleKey, sample_seed
from memfit.data.seeded import SeededDataset
from memfit.data.shapes import SHAPES, ShapesDataset
from memfit.data.shapes_coco import write_shapes_coco
from memfit.data.transforms import build_transform, build_transforms, default_image_transform

__all__ = [
    "SHAPES",
    "AspectRatioBatchSampler",
    "CocoDataset",
    "DefaultSampler",
    "FeistelPermutation",
    "ImageFolder",
    "InfiniteSampler",
    "SampleKey",
    "SeededDataset",
    "ShapesDataset",
    "adapt_dataloader",
    "build_collate_fn",
    "build_dataloader",
    "build_sampler",
    "build_transform",
    "build_transforms",
    "default_image_transform",
    "sample_seed",
    "write_shapes_coco",
]
