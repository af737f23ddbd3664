"""memfit: train large vision models on small GPUs; the same config on many GPUs and machines."""

from memfit import data, evaluator, hooks, model, optim  # noqa: E402,F401  (registers built-in types)
from memfit._version import __version__
from memfit.runner import FlexibleRunner, Runner  # noqa: E402

__all__ = ["Runner", "FlexibleRunner", "__version__"]
