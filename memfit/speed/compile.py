"""``torch.compile`` as a config switch: regional (each repeated block compiled in place) by default.

The Runner's ``compile=True`` (MMEngine's key) compiles every block :func:`memfit.model.blocks.find_blocks`
finds (a Swin or ViT block, a ResNet bottleneck) with ``block.compile()``, as torchtitan does: the blocks
of one type share one graph, so a 24-block model compiles in about the time of one block, and the code
between blocks (heads, losses, a detector's Python post-processing) stays eager. ``compile=dict(
regional=False, ...)`` compiles the whole model instead; the other keys (``backend``, ``mode``,
``fullgraph``, ``dynamic``, ``options``, ``disable``) are ``torch.compile``'s.

``Module.compile`` keeps the module's identity: parameter names, ``state_dict`` keys and hooks are
unchanged (``torch.compile(model)`` would return a wrapper whose keys gain ``_orig_mod.``), and a
``copy.deepcopy`` (an EMA model) is an uncompiled copy. The connector applies it after the memory
techniques and the precision's conversion and before the strategy wraps the model (torchtitan's
order): a checkpointed block is compiled with its checkpoint inside the graph, FSDP2 shards the
compiled blocks (dynamo runs FSDP's hooks eagerly), and DDP's wrapper calls the compiled model.
"""

from __future__ import annotations

import inspect
import logging
import shutil
import sys
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError, did_you_mean
from memfit.model.blocks import find_blocks

logger = logging.getLogger("memfit")

# torch.compile's own options (its first argument is the model), and memfit's ``regional``.
TORCH_COMPILE_KEYS = tuple(n for n in inspect.signature(torch.compile).parameters if n != "model")
COMPILE_KEYS = ("regional", *TORCH_COMPILE_KEYS)
# Backends that trace and run the graph in Python: no code generation, so no compiler is needed.
_NO_CODEGEN = ("eager", "aot_eager", "aot_eager_decomp_partition")


def compile_options(spec: Any) -> dict[str, Any] | None:
    """The Runner's ``compile`` value as ``torch.compile`` options plus ``regional`` (default True);
    None when compile is off. Unknown keys and wrong types are a one-line ConfigError."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return {"regional": True}
    if not isinstance(spec, dict):
        raise ConfigError(f"compile must be True, False or a dict of torch.compile options, got "
                          f"{type(spec).__name__} {spec!r}")
    for key in spec:
        if key not in COMPILE_KEYS:
            raise ConfigError(f"compile.{key}: unknown option; valid: {', '.join(COMPILE_KEYS)}")
    regional = spec.get("regional", True)
    if not isinstance(regional, bool):
        raise ConfigError(f"compile.regional must be True (each repeated block) or False (the whole model), "
                          f"got {regional!r}")
    _check_named(spec, "mode", _modes)
    _check_named(spec, "backend", lambda: torch._dynamo.list_backends(exclude_tags=()))
    return {**spec, "regional": regional}


def _modes() -> list[str]:
    import torch._inductor

    return list(torch._inductor.list_mode_options())


def _check_named(spec: dict[str, Any], key: str, names: Any) -> None:
    """A string ``spec[key]`` must be one of ``names()`` (torch.compile's modes or backends), else one line naming
    them, before anything is built (torch says so at the first step; a backend may also be a callable)."""
    value = spec.get(key)
    if isinstance(value, str) and value not in (known := list(names())):
        raise ConfigError(f"compile.{key}={value!r}: not one of torch.compile's {key}s: {did_you_mean(value, known)}")


def _cpp_compilers() -> list[str]:
    """The C++ compilers inductor tries on this host, in its order (``torch._inductor.config.cpp.cxx``)."""
    if sys.platform == "win32":
        import os

        return [os.environ.get("CXX", "cl")]
    from torch._inductor import config

    cxx = config.cpp.cxx
    return [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler inductor would use for CPU kernels is on the PATH."""
    return any(shutil.which(c) for c in _cpp_compilers())


def has_triton() -> bool:
    """Whether Triton, which inductor generates CUDA kernels with, is installed and usable."""
    from torch.utils._triton import has_triton as torch_has_triton

    return torch_has_triton()


def check_compiler(options: dict[str, Any], device: torch.device) -> None:
    """Fail before training, in one line, when ``options``' backend cannot compile on ``device``: inductor
    needs a C++ compiler on a CPU and Triton on CUDA (``eager``/``aot_eager`` need neither)."""
    backend = options.get("backend", "inductor")
    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(f"compile: torch.compile does not run on Python {sys.version.split()[0]} with torch "
                          f"{torch.__version__}; remove compile")
    if backend != "inductor" or options.get("disable"):
        return  # a custom backend (a callable, another name) checks its own needs
    if device.type == "cpu" and not has_cpp_compiler():
        raise ConfigError(f"compile: the inductor backend needs a C++ compiler on this CPU (none of "
                          f"{', '.join(_cpp_compilers()) or 'g++'} found): install g++ or set CXX, or use "
                          "compile=dict(backend='aot_eager') (no code generation) or remove compile")
    if device.type == "cuda" and not has_triton():
        raise ConfigError("compile: the inductor backend needs Triton on CUDA (not installed or no usable GPU): "
                          "pip install triton, or use compile=dict(backend='aot_eager') or remove compile")


def apply_compile(model: nn.Module, options: dict[str, Any]) -> list[str]:
    """Compile ``model`` in place as :func:`compile_options` describes; returns the qualified names of the
    compiled modules (``''``: the whole model). Regional with no repeated blocks compiles the whole model
    and says so in one info line."""
    options = dict(options)
    regional = options.pop("regional", True)
    blocks = find_blocks(model) if regional else {}
    if regional and not blocks:
        logger.info(f"compile: {type(model).__name__} has no repeated blocks; compiling the whole model")
    if not blocks:
        model.compile(**options)
        return [""]
    # Static shapes unless asked: blocks of one type in several shapes would otherwise make dynamo recompile
    # them with symbolic sizes (its automatic dynamic shapes), whose kernels ran a ResNet-50 at 0.63x eager's
    # speed on an H100 (benchmarks/gpu_throughput.py, torch 2.11); a graph per shape is what a training step needs.
    options.setdefault("dynamic", False)
    for block in blocks.values():
        block.compile(**options)
    _allow_recompiles(len(blocks))
    kinds = sorted({type(b).__name__ for b in blocks.values()})
    logger.info(f"compile: {len(blocks)} blocks compiled in place ({', '.join(kinds)})")
    return list(blocks)


def _allow_recompiles(n_blocks: int) -> None:
    """Let each block's forward keep a graph per block, in training and in evaluation, and per memory format.

    Blocks of one type share one code object, and dynamo keeps at most ``recompile_limit`` graphs per code object
    (8 by default) before it runs the rest eagerly with a warning. Blocks of one type but different shapes (a
    ResNet-50 has 16 bottlenecks in 8 shapes) need a graph each, and evaluation (BatchNorm's and dropout's mode,
    no grad) a second: 4 per block leaves room for a second memory format too."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < 4 * n_blocks:
        setattr(config, name, 4 * n_blocks)


def compiled_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules in ``model`` compiled with ``Module.compile`` (``''``: the model),
    also a model whose compiled call a strategy's wrapper runs (:mod:`memfit.strategies.route`)."""
    return [n for n, m in model.named_modules() if m.__dict__.get("_compiled_call_impl") is not None
            or getattr(m.__dict__.get("_call_impl"), "compiled", None) is not None]
