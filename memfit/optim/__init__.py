"""Optimizer wrappers, optimizer/param-group building and parameter schedulers."""

from memfit.optim import larc  # noqa: F401  (registers Larc)
from memfit.optim.builder import build_optim_wrapper, build_optimizer
from memfit.optim.wrapper import AmpOptimWrapper, OptimWrapper

__all__ = ["OptimWrapper", "AmpOptimWrapper", "build_optim_wrapper", "build_optimizer"]
