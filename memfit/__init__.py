"""memfit: train large vision models on small GPUs; the same config on many GPUs and machines."""

__version__ = "0.1.0"

from memfit import data, evaluator, hooks, model, optim  # noqa: E402,F401  (registers built-in types)
from memfit.runner import FlexibleRunner, Runner  # noqa: E402

__all__ = ["Runner", "FlexibleRunner", "__version__"]
