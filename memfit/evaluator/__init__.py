"""Evaluation: the BaseMetric contract, the Evaluator and built-in metrics."""

from memfit.evaluator.accuracy import Accuracy
from memfit.evaluator.coco_metric import CocoMetric
from memfit.evaluator.dump import DumpResults
from memfit.evaluator.metric import BaseMetric, Evaluator

__all__ = ["Accuracy", "BaseMetric", "CocoMetric", "DumpResults", "Evaluator"]
