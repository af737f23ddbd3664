"""Optimizer wrappers, optimizer/param-group building and parameter schedulers."""

from memfit.optim import larc  # noqa: F401  (registers Larc)
from memfit.optim.builder import (
    DefaultOptimWrapperConstructor,
    MultiOptimWrapperConstructor,
    build_optim_wrapper,
    build_optimizer,
)
from memfit.optim.wrapper import AmpOptimWrapper, OptimWrapper
from memfit.optim.wrapper_dict import OptimWrapperDict

__all__ = ["OptimWrapper", "AmpOptimWrapper", "OptimWrapperDict", "DefaultOptimWrapperConstructor",
           "MultiOptimWrapperConstructor", "build_optim_wrapper", "build_optimizer"]
