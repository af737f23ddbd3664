"""How benchmarks/record_allocator_traces.py records the CUDA caching allocator: torch's recording API, guarded,
and the hook that records each case's steps.

When recording starts (decided: from a known state, the model and optimizer already built). A hook of the lowest
priority (:class:`Recorder`), in ``before_train`` (after memfit's set-up put the model on the GPU, applied the
techniques, wrapped it and built the optimizer; before the loader's first batch is fetched), synchronises,
releases cuBLAS's cached workspaces (``torch._C._cuda_clearCublasWorkspaces``, so each case allocates its own, in
its trace, whatever ran before), runs ``gc.collect()`` and ``torch.cuda.empty_cache()``, resets the peak and the
accumulated statistics, takes a snapshot without recording (the *initial segments*: what the built model holds,
parameters and buffers; AdamW's state is created lazily, so inside the trace) and then starts
``torch.cuda.memory._record_memory_history(enabled='all', context=None, stacks='python', max_entries=...)`` (no
stack frames; older signatures are tried in turn: see :func:`start_recording`). After each iteration the same hook
takes ``torch.cuda.memory._snapshot()``: the trace so far (its length marks the step's end), the segments then and
``torch.cuda.memory_stats()``'s counters. After the last step the trace is kept, recording stops
(``enabled=None``, which also clears torch's history) and ``max_memory_allocated``/``max_memory_reserved`` and the
whole ``memory_stats()`` are read. Each case's trace thus runs from the initial segments to the final ones:
replaying it over the initial segments must end in the final segments.

Allocator settings: the native caching allocator with expandable segments off. If ``PYTORCH_CUDA_ALLOC_CONF``
(or torch's newer ``PYTORCH_ALLOC_CONF``) turns them on, the script turns them off before CUDA starts
(``torch.cuda.memory._set_allocator_settings``); the raw variables are written to the file and every segment
keeps its ``is_expandable``. ``cudnn.benchmark`` is memfit's default (off).
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from allocator_trace_format import STEP_STATS, compact_segments, device_trace, jsonable

from memfit.hooks import Hook

ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
             "CUBLAS_WORKSPACE_CONFIG")


def start_recording(max_entries: int, frames: bool = False) -> str:
    """Start recording the allocator's history without stack frames (``frames``: with each allocation's Python
    frames); returns the call that worked."""
    rec = torch.cuda.memory._record_memory_history
    tries = [("enabled='all', context='alloc', stacks='python'",
              dict(enabled="all", context="alloc", stacks="python", max_entries=max_entries))] if frames else []
    tries += [
        ("enabled='all', context=None, stacks='python', clear_history=True",
         dict(enabled="all", context=None, stacks="python", max_entries=max_entries, clear_history=True)),
        ("enabled='all', context=None, stacks='python'",
         dict(enabled="all", context=None, stacks="python", max_entries=max_entries)),
        ("enabled='all', context=None", dict(enabled="all", context=None, max_entries=max_entries)),
    ]
    errors = []
    for how, kwargs in tries:
        try:
            rec(**kwargs)
            return how
        except (TypeError, RuntimeError, ValueError) as exc:
            errors.append(f"{how}: {type(exc).__name__}: {exc}")
    try:  # the legacy boolean form (torch 2.0)
        rec(True, record_context=False, trace_alloc_max_entries=max_entries, trace_alloc_record_context=False)
        return "legacy: True, record_context=False, trace_alloc_record_context=False"
    except (TypeError, RuntimeError, ValueError) as exc:
        errors.append(f"legacy: {type(exc).__name__}: {exc}")
    raise RuntimeError("could not start _record_memory_history: " + " | ".join(errors))


def stop_recording() -> None:
    """Stop recording (torch also clears its history then); never raises."""
    rec = torch.cuda.memory._record_memory_history
    for args, kwargs in (((), dict(enabled=None)), ((False,), {})):
        try:
            rec(*args, **kwargs)
            return
        except Exception:  # noqa: BLE001, S112 - try the older form
            continue


def take_snapshot() -> dict:
    return torch.cuda.memory._snapshot()


def clear_cublas_workspaces() -> bool:
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is None:
        return False
    try:
        fn()
        return True
    except Exception:  # noqa: BLE001 - an older torch: its workspaces then persist across cases
        return False


def memory_stats() -> dict:
    try:
        return {k: jsonable(v) for k, v in torch.cuda.memory_stats().items()}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def allocator_backend() -> str | None:
    fn = getattr(torch.cuda, "get_allocator_backend", None)
    try:
        return fn() if fn else None
    except Exception:  # noqa: BLE001
        return None


def ensure_no_expandable_segments(log: Callable[[str], None]) -> bool:
    """Turn expandable segments off if the environment turned them on (before CUDA allocates); True if done."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return False
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    try:
        setter("expandable_segments:False")
        log("expandable segments were on in the environment: turned off for this run")
        return True
    except Exception as exc:  # noqa: BLE001
        log(f"WARNING: expandable segments are on in the environment and could not be turned off ({exc}); "
            "the segments' is_expandable says what was recorded")
        return False


class Recorder(Hook):
    """Starts recording in ``before_train`` (after every other hook), marks each iteration's end, and ends the
    recording after ``steps`` iterations. On a CPU (``--dry``) it only counts iterations."""

    priority = "LOWEST"

    def __init__(self, steps: int, cuda: bool, max_entries: int) -> None:
        self.steps, self.cuda, self.max_entries = steps, cuda, max_entries
        self.device = 0
        self.recording = False
        self.how: str | None = None
        self.cublas_cleared = False
        self.initial: dict[str, Any] = {}
        self.marks: list[dict] = []
        self.final: dict[str, Any] = {}
        self.iters = 0
        self.built: dict[str, Any] = {}

    def before_train(self, runner: Any) -> None:
        self.built = built_summary(runner)
        if not self.cuda:
            return
        self.device = torch.cuda.current_device()
        torch.cuda.synchronize()
        gc.collect()
        self.cublas_cleared = clear_cublas_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reset = getattr(torch.cuda, "reset_accumulated_memory_stats", None)
        if reset is not None:
            reset()
        snap = take_snapshot()
        self.initial = {"segments": compact_segments(snap, self.device), "allocated": torch.cuda.memory_allocated(),
                        "reserved": torch.cuda.memory_reserved()}
        self.how = start_recording(self.max_entries)
        self.recording = True

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self.iters += 1
        if not self.recording:
            return
        snap = take_snapshot()
        entries = device_trace(snap, self.device)
        stats = torch.cuda.memory_stats()
        self.marks.append({"iter": int(runner.iter), "trace_len": len(entries),
                           "stats": {k: jsonable(stats.get(k)) for k in STEP_STATS},
                           "segments": compact_segments(snap, self.device)})
        if len(self.marks) >= self.steps:
            self.finish(entries)

    def finish(self, entries: list[dict]) -> None:
        torch.cuda.synchronize()
        self.final = {"entries": entries,
                      "peaks": {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                "max_memory_reserved": torch.cuda.max_memory_reserved(),
                                "memory_allocated": torch.cuda.memory_allocated(),
                                "memory_reserved": torch.cuda.memory_reserved()},
                        "memory_stats": memory_stats()}
        self.stop()

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            stop_recording()


def built_summary(runner: Any) -> dict:
    """What memfit's set-up built: strategy, optimizer, wrapped forwards, FSDP modules, parameters."""
    from memfit.memory.wrapping import wrapped_forward

    model = runner.model
    wrapped = Counter(w.kind for m in model.modules() if (w := wrapped_forward(m)) is not None)
    fsdp = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
    opt = getattr(runner.optim_wrapper, "optimizer", None)
    params = list(model.parameters())
    return {"strategy": type(runner.strategy).__name__, "model": type(model).__name__,
            "optim_wrapper": type(runner.optim_wrapper).__name__, "optimizer": type(opt).__name__,
            "wrapped_forwards": dict(wrapped), "fsdp_modules": fsdp, "parameters": sum(p.numel() for p in params),
            "parameter_device": str(params[0].device) if params else None,
            "parameter_types": sorted({type(p).__name__ for p in params})}
