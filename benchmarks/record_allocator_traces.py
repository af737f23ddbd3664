"""Record the CUDA caching allocator's real traces of a few training steps, as small test fixtures.

    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR              # one GPU: under 2 minutes
    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR --only vit   # cases whose name has 'vit'
    PYTHONPATH=. python3 benchmarks/record_allocator_traces.py --out DIR --dry        # CPU: checks the script

What it records. Each case is a memfit Runner built from a config dict (as a user writes it, and as the
planner's fake step runs it), trained for ``--steps`` (3) iterations on in-memory random images, bf16
autocast (AmpOptimWrapper), AdamW lr 1e-3, no pretrained weights, drop_path 0, no validation, no
checkpoints and no LoggerHook (its line at an epoch's last iteration resets the peak statistics),
``num_workers=0``, seed 0:

* ``vit_s16``: timm ``vit_small_patch16_224``, batch 32, 224 px;
* ``swin_t``: timm ``swin_tiny_patch4_window7_224``, batch 16, 224 px;
* ``resnet50``: torchvision ``resnet50``, batch 64, 160 px (ImageClassifier);
* ``vit_s16_ac_blocks``: ``vit_s16`` with ``cfg=dict(activation_checkpointing=dict(types=['Block']))`` (memfit's
  checkpointing of every timm ViT block, as the planner's 'blocks' plan sets it);
* ``vit_s16_optimizer_offload``: ``vit_s16`` with ``cfg=dict(optimizer_offload=True)`` (AdamW state and step on
  the host; the pinned host buffers are not in the device trace);
* ``vit_s16_fsdp``: ``vit_s16`` with ``strategy=dict(type='FSDPStrategy')`` (FSDP2 ``fully_shard`` per block) on a
  one-rank group that memfit makes itself (``dist.ensure_process_group``: nccl, rank 0, world size 1, an
  in-memory store); FSDP2's all-gathers and reduce-scatters allocate on their own streams, so its entries
  carry streams other than the default one (so do the loader's: memfit's prefetcher copies each next batch on
  a side stream of its own in every case). Run last; the process group is destroyed after it.

When recording starts (decided: from a known state, the model and optimizer already built). A hook of the
lowest priority, in ``before_train`` (after memfit's set-up put the model on the GPU, applied the techniques,
wrapped it and built the optimizer; before the loader's first batch is fetched), synchronises, releases
cuBLAS's cached workspaces (``torch._C._cuda_clearCublasWorkspaces``, so each case allocates its own, in its
trace, whatever ran before), runs ``gc.collect()`` and ``torch.cuda.empty_cache()``, resets the peak and the
accumulated statistics, takes a snapshot without recording (the *initial segments*: what the built model
holds, parameters and buffers; AdamW's state is created lazily, so inside the trace) and then starts
``torch.cuda.memory._record_memory_history(enabled='all', context=None, stacks='python', max_entries=...)``
(no stack frames; older signatures are tried in turn: see :func:`start_recording`). After each iteration the
same hook takes ``torch.cuda.memory._snapshot()``: the trace so far (its length marks the step's end), the
segments then and ``torch.cuda.memory_stats()``'s counters. After the last step the trace is kept, recording
stops (``enabled=None``, which also clears torch's history) and ``max_memory_allocated``/``max_memory_reserved``
and the whole ``memory_stats()`` are read. Each case's trace thus runs from the initial segments to the
final ones: replaying it over the initial segments must end in the final segments.

Allocator settings: the native caching allocator with expandable segments off. If ``PYTORCH_CUDA_ALLOC_CONF``
(or torch's newer ``PYTORCH_ALLOC_CONF``) turns them on, the script turns them off before CUDA starts
(``torch.cuda.memory._set_allocator_settings``); the raw variables are written to the file and every segment
keeps its ``is_expandable``. ``cudnn.benchmark`` is memfit's default (off).

The file: ``DIR/allocator_traces.json.gz`` (gzip of one JSON document; no pickle, so a test loads it with
``json.load(gzip.open(path, 'rt'))``), rewritten after every case so an interrupted run keeps the cases done.
Top-level keys:

* ``format`` ('memfit.allocator_traces'), ``format_version`` (1), ``created_utc``, ``command``, ``dry``, ``seconds``;
* ``env``: ``torch``, ``cuda`` (``torch.version.cuda``), ``cudnn``, ``nccl``, ``gpu`` (name), ``gpu_memory`` (bytes),
  ``capability``, ``timm``, ``torchvision``, ``memfit``, ``git_commit``, ``python``;
* ``allocator``: ``backend`` ('native'), ``env`` (the raw allocator variables: PYTORCH_CUDA_ALLOC_CONF,
  PYTORCH_ALLOC_CONF, PYTORCH_NO_CUDA_MEMORY_CACHING, CUBLAS_WORKSPACE_CONFIG; null when unset),
  ``expandable_segments`` (False unless a segment says otherwise), ``expandable_segments_turned_off`` (the
  script had to), ``recording`` (the ``_record_memory_history`` call that worked), ``max_entries``;
* ``trace_fields``: ``['action', 'addr', 'size', 'stream']``, the columns of each trace row; ``block_fields``:
  ``['address', 'size', 'requested_size', 'state']``, the columns of each segment's block rows;
* ``cases``: one object per case, in the order run.

A case: ``name``, ``description``, ``config`` (summary: model, image_size, batch, steps, precision, optimizer,
techniques, strategy), ``runner_cfg`` (the config dict given to ``Runner.from_cfg``, classes by name; the
dataset is this file's ``RandomImages``), ``torch``, ``cuda``, ``gpu`` (repeated from ``env`` so a case stands
alone), then

* ``initial``: ``segments``, ``allocated`` and ``reserved`` bytes when recording started;
* ``trace``: the allocator's entries in order, one row each (``trace_fields``): ``action`` as torch gives it
  ('alloc', 'free_requested', 'free_completed', 'segment_alloc', 'segment_free', 'oom', 'snapshot', ...),
  ``addr``, ``size`` (as torch records it: in the versions read, the requested bytes before rounding for
  alloc/free entries, the cudaMalloc size for segment entries) and ``stream`` (the cudaStream_t as an int; 0 is
  the legacy default stream). Frames, times and annotations are dropped. ``trace_extras`` maps a row's index
  (as a string) to any other key the entry had (e.g. ``device_free`` of an 'oom', a non-default ``pool_id``);
  ``trace_actions`` counts rows per action; ``trace_truncated`` is True when torch's ring buffer of
  ``max_entries`` filled (the oldest rows are then lost: do not replay such a case);
* ``steps``: per iteration, ``iter``, ``trace_len`` (rows of ``trace`` recorded by the end of the iteration:
  ``trace[:trace_len]``; a 'snapshot' row, where torch writes one, may fall on either side), ``stats`` (counters
  of ``memory_stats()`` then: allocations, frees, segments allocated/freed since recording started,
  allocated/reserved bytes now and at their peak) and ``segments`` (the segments then);
* ``final_segments``: the segments after the last step (the same as ``steps[-1]['segments']``);
* ``peaks``: ``max_memory_allocated``, ``max_memory_reserved`` (since recording started), ``memory_allocated``,
  ``memory_reserved`` (at the end); ``segment_counts``: ``memory_stats()``'s segment counts (current and peak,
  all/large/small pools) and ``num_alloc_retries``, ``num_ooms``; ``memory_stats``: the whole of it;
* ``checks``: the trace's own consistency: ``reserved_ok`` is True when the initial segments plus the
  segment_alloc less the segment_free rows give torch's final ``memory_reserved`` and, at their running
  maximum, ``max_memory_reserved`` (so no segment event is missing); ``peak_requested_from_trace`` against
  ``requested_bytes_peak`` (torch's, where it has it) is informative;
* ``built``: what memfit's set-up built (strategy, model and optimizer classes, wrapped forwards by technique,
  FSDP modules, parameter count, device and class), read in ``before_train``;
* ``seconds``: the case's wall time, building included;
* or ``error`` (and ``traceback``) for a case that failed, ``skipped`` for one the time budget left out.

A segment: ``address``, ``total_size``, ``stream``, ``segment_type`` ('small'|'large'), ``segment_pool_id``,
``is_expandable``, ``allocated_size``, ``active_size``, ``requested_size`` (where torch gives them) and
``blocks``, rows of ``block_fields`` in address order (``state``: 'active_allocated', 'active_awaiting_free'
or 'inactive').

How a replay test uses it (written by a later change): for each case without ``error``/``skipped``/
``trace_truncated``, seed memfit's ``CachingAllocatorModel`` with the initial segments (one per initial segment,
its allocated blocks marked allocated), replay the rows in order (``alloc`` -> ``malloc(addr, size)``;
``free_completed`` -> ``free(addr)``, or ``free_requested`` when streams are ignored; ``segment_*`` rows are
the allocator's own decisions, the ones to compare), and compare: the model's peak reserved with
``peaks['max_memory_reserved']``, its peak allocated with ``max_memory_allocated`` (rounded sizes), and its
segment sizes per pool with ``final_segments`` (and ``steps[i]['segments']``). Cases whose rows carry several
streams (FSDP, the prefetcher's copies) test the per-stream rules, or are expected to differ from a one-stream
model where memfit's model does not have them.

Size and time: unknown until run on a GPU. The cases are sized for a file of a few MiB (target < 5 MiB
gzipped; ``--max-entries`` caps each case) and for about a minute on one H100; the budget (``--budget-s``, 110
s) skips the remaining cases, with a line saying so, when too little is left. One line per case is printed:
trace rows, allocs, segment_allocs, streams, peak allocated/reserved in MiB, final segments, seconds (and a
warning where ``checks`` fail). Without CUDA the script exits 2 with one line, unless
``--dry``: then every case is built on the CPU (tiny models: ViT-Ti at 32 px, 2 Swin stages at 64 px,
ResNet-18 at 32 px, batch 2; FSDP on a one-rank gloo group) and trained for one step without recording, and
the file's serialisation is exercised on a synthetic snapshot shaped as torch documents it; the file is
``allocator_traces_dry.json.gz`` then.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.perf_counter()
if "--dry" in sys.argv[1:]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine: set before torch can start CUDA

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from memfit.hooks import Hook  # noqa: E402

FORMAT_VERSION = 1
TRACE_FIELDS = ("action", "addr", "size", "stream")
BLOCK_FIELDS = ("address", "size", "requested_size", "state")
SEGMENT_KEYS = ("address", "total_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "allocated_size", "active_size", "requested_size")
DROPPED_TRACE_KEYS = {"frames", "time_us", "compile_context", "user_metadata", "device"}
STEP_STATS = ("allocation.all.allocated", "allocation.all.freed", "segment.all.allocated", "segment.all.freed",
              "allocated_bytes.all.current", "reserved_bytes.all.current", "allocated_bytes.all.peak",
              "reserved_bytes.all.peak", "num_alloc_retries")
SEGMENT_COUNT_KEYS = ("segment.all.current", "segment.all.peak", "segment.large_pool.current",
                      "segment.large_pool.peak", "segment.small_pool.current", "segment.small_pool.peak",
                      "segment.all.allocated", "segment.all.freed", "num_alloc_retries", "num_ooms")
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
             "CUBLAS_WORKSPACE_CONFIG")
RESERVE_S = 6.0  # kept for writing the file
MIB = 2**20
# No checkpoints, and no LoggerHook at all: its log line of an epoch's last iteration calls
# torch.cuda.reset_peak_memory_stats, which would hide the recorded steps' peaks.
HOOKS = dict(checkpoint=None, logger=None)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- data and cases ----------------------------------------------------------------------------------------
class RandomImages(Dataset):
    """``length`` items cycling through ``count`` images drawn once (seed 0): ``{'img': float32 [3, S, S]
    (standard normal, as normalised images), 'label': int}``. Only indexing, so the loader adds nothing."""

    def __init__(self, image_size: int, count: int, length: int, num_classes: int = 1000) -> None:
        g = torch.Generator().manual_seed(0)
        self.img = torch.randn(count, 3, image_size, image_size, generator=g)
        self.label = torch.randint(num_classes, (count,), generator=g).tolist()
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = i % self.count
        return {"img": self.img[j], "label": self.label[j]}


@dataclass(frozen=True)
class Model:
    label: str
    kind: str  # 'timm' | 'torchvision'
    name: str
    size: int
    batch: int
    kwargs: dict = field(default_factory=dict)

    def cfg(self) -> dict:
        if self.kind == "torchvision":
            return dict(type="ImageClassifier", backbone=dict(type=self.name, num_classes=1000))
        return dict(type="TimmClassifier", model_name=self.name, num_classes=1000, drop_path_rate=0.0, **self.kwargs)


MODELS = {
    "vit": Model("ViT-S/16 224px b32", "timm", "vit_small_patch16_224", 224, 32),
    "swin": Model("Swin-T 224px b16", "timm", "swin_tiny_patch4_window7_224", 224, 16),
    "resnet": Model("ResNet-50 160px b64", "torchvision", "resnet50", 160, 64),
}
DRY_MODELS = {
    "vit": Model("ViT-Ti/16 32px b2 (dry)", "timm", "vit_tiny_patch16_224", 32, 2, dict(img_size=32)),
    "swin": Model("Swin (2 stages of Swin-T) 64px b2 (dry)", "timm", "swin_tiny_patch4_window7_224", 64, 2,
                  dict(img_size=64, depths=(2, 2), num_heads=(3, 6))),
    "resnet": Model("ResNet-18 32px b2 (dry)", "torchvision", "resnet18", 32, 2),
}


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # key of MODELS
    description: str
    techniques: dict = field(default_factory=dict)  # the Runner's cfg=dict(...)
    strategy: dict | None = None
    est_s: float = 8.0  # skipped when less time than this (plus RESERVE_S) is left


CASES = [
    Case("vit_s16", "vit", "timm ViT-S/16, bf16 autocast, AdamW", est_s=8),
    Case("swin_t", "swin", "timm Swin-T, bf16 autocast, AdamW", est_s=8),
    Case("resnet50", "resnet", "torchvision ResNet-50, bf16 autocast, AdamW", est_s=8),
    Case("vit_s16_ac_blocks", "vit", "ViT-S/16 with memfit's activation checkpointing of every Block",
         techniques=dict(activation_checkpointing=dict(types=["Block"])), est_s=8),
    Case("vit_s16_optimizer_offload", "vit", "ViT-S/16 with memfit's optimizer offload (AdamW on the host)",
         techniques=dict(optimizer_offload=True), est_s=10),
    Case("vit_s16_fsdp", "vit", "ViT-S/16 under memfit's FSDPStrategy (FSDP2) on one rank (nccl, world size 1)",
         strategy=dict(type="FSDPStrategy"), est_s=15),
]


def runner_cfg(case: Case, model: Model, steps: int, cuda: bool, dtype: str, work_dir: str, hook: Hook) -> dict:
    """The Runner config of a case: what a user writes, with a dataset of exactly ``steps`` batches."""
    cfg: dict[str, Any] = dict(
        model=model.cfg(), work_dir=work_dir,
        optim_wrapper=dict(type="AmpOptimWrapper", dtype=dtype, optimizer=dict(type="AdamW", lr=1e-3)) if dtype
        else dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-3)),
        train_cfg=dict(by_epoch=False, max_iters=steps),
        train_dataloader=dict(batch_size=model.batch, num_workers=0, pin_memory=cuda, drop_last=True,
                              sampler=dict(type="DefaultSampler", shuffle=True),
                              dataset=dict(type=RandomImages, image_size=model.size, count=model.batch,
                                           length=model.batch * steps)),
        default_hooks=HOOKS, custom_hooks=[hook], log_level="WARNING", randomness=dict(seed=0))
    if case.techniques:
        cfg["cfg"] = dict(case.techniques)
    if case.strategy:
        cfg["strategy"] = dict(case.strategy)
    return cfg


# -- torch's recording API, guarded ------------------------------------------------------------------------
def start_recording(max_entries: int) -> str:
    """Start recording the allocator's history without stack frames; returns the call that worked."""
    rec = torch.cuda.memory._record_memory_history
    tries = [
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
        return {k: _jsonable(v) for k, v in torch.cuda.memory_stats().items()}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def allocator_backend() -> str | None:
    fn = getattr(torch.cuda, "get_allocator_backend", None)
    try:
        return fn() if fn else None
    except Exception:  # noqa: BLE001
        return None


def ensure_no_expandable_segments() -> bool:
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


# -- compacting torch's snapshot ---------------------------------------------------------------------------
def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, torch.dtype):
        return str(x)
    return repr(x)


def compact_segments(snapshot: dict, device: int | None) -> list[dict]:
    """The segments of one device: their keys (SEGMENT_KEYS, where given) and block rows (BLOCK_FIELDS)."""
    out = []
    for seg in snapshot.get("segments", []):
        if device is not None and seg.get("device", device) != device:
            continue
        row = {k: _jsonable(seg[k]) for k in SEGMENT_KEYS if k in seg}
        blocks = sorted(seg.get("blocks", []), key=lambda b: b.get("address", 0))
        row["blocks"] = [[b.get(k) for k in BLOCK_FIELDS] for b in blocks]
        out.append(row)
    out.sort(key=lambda s: s.get("address", 0))
    return out


def _default_pool(v: Any) -> bool:
    try:
        return tuple(v) == (0, 0)
    except TypeError:
        return False


def compact_trace(entries: list[dict]) -> tuple[list[list], dict[str, dict], dict[str, int]]:
    """Rows of TRACE_FIELDS, the other keys of the entries that have any, and the count of each action."""
    rows, extras, counts = [], {}, Counter()
    for i, e in enumerate(entries):
        rows.append([_jsonable(e.get(k)) for k in TRACE_FIELDS])
        counts[str(e.get("action"))] += 1
        more = {k: _jsonable(v) for k, v in e.items()
                if k not in TRACE_FIELDS and k not in DROPPED_TRACE_KEYS and not (k == "pool_id" and _default_pool(v))}
        if more:
            extras[str(i)] = more
    return rows, extras, dict(counts)


def device_trace(snapshot: dict, device: int) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    if len(traces) > device:
        return traces[device]
    return traces[0] if len(traces) == 1 else []


def synthetic_snapshot() -> dict:
    """A snapshot shaped as torch.cuda.memory._snapshot's docstring describes it (for --dry)."""
    base = 0x7F0000000000
    return {
        "segments": [{"device": 0, "address": base, "total_size": 2 * MIB, "stream": 0, "segment_type": "small",
                      "segment_pool_id": (0, 0), "allocated_size": 512, "active_size": 512, "requested_size": 100,
                      "is_expandable": False,
                      "blocks": [{"address": base + 512, "size": 2 * MIB - 512, "requested_size": 0,
                                  "state": "inactive", "frames": []},
                                 {"address": base, "size": 512, "requested_size": 100, "state": "active_allocated",
                                  "frames": [{"filename": "x.py", "line": 1, "name": "f"}]}]}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": base, "size": 2 * MIB, "stream": 0, "frames": [], "time_us": 1},
            {"action": "alloc", "addr": base, "size": 100, "stream": 0, "frames": [], "time_us": 2,
             "pool_id": (0, 0)},
            {"action": "free_requested", "addr": base, "size": 100, "stream": 7, "frames": []},
            {"action": "free_completed", "addr": base, "size": 100, "stream": 7, "frames": []},
            {"action": "oom", "size": 10 * MIB, "stream": 0, "device_free": 4096, "frames": []},
        ]],
    }


# -- the recording hook ------------------------------------------------------------------------------------
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
                           "stats": {k: _jsonable(stats.get(k)) for k in STEP_STATS},
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


# -- one case ----------------------------------------------------------------------------------------------
def environment(cuda: bool) -> dict:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        env["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        env["cudnn"] = None
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=torch.cuda.get_device_name(), gpu_memory=int(props.total_memory),
                   capability=f"{props.major}.{props.minor}")
        try:
            env["nccl"] = _jsonable(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            env["nccl"] = None
    for mod in ("timm", "torchvision"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    from memfit._version import __version__

    env["memfit"] = __version__
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True,
                                           capture_output=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def run_case(case: Case, args: argparse.Namespace, env: dict) -> dict:
    from memfit.runner import Runner

    cuda = not args.dry
    model = (DRY_MODELS if args.dry else MODELS)[case.model]
    steps = 1 if args.dry else args.steps
    dtype = "bfloat16"  # on the CPU too (--dry): tiny models, and the same precision code paths
    start = time.perf_counter()
    hook = Recorder(steps, cuda, args.max_entries)
    rec: dict[str, Any] = {"name": case.name, "description": case.description,
                           "config": {"model": model.label, "model_name": model.name, "image_size": model.size,
                                      "batch": model.batch, "steps": steps, "precision": f"{dtype} autocast",
                                      "optimizer": "AdamW lr 1e-3", "techniques": _jsonable(case.techniques),
                                      "strategy": _jsonable(case.strategy) or "SingleDeviceStrategy"},
                           "torch": env.get("torch"), "cuda": env.get("cuda"), "gpu": env.get("gpu")}
    with tempfile.TemporaryDirectory(prefix="memfit-traces-") as work_dir:
        cfg = runner_cfg(case, model, steps, cuda, dtype, work_dir, hook)
        rec["runner_cfg"] = _jsonable({k: v for k, v in cfg.items() if k not in ("work_dir", "custom_hooks")})
        runner = None
        try:
            torch.manual_seed(0)
            runner = Runner.from_cfg(cfg)
            runner.train()
        finally:
            hook.stop()
            del runner
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    if hook.iters != steps:
        raise RuntimeError(f"the Runner ran {hook.iters} iterations, {steps} expected")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    rec["built"] = hook.built
    if not cuda:
        return rec
    if not hook.final:
        raise RuntimeError(f"recording did not finish: {len(hook.marks)} of {steps} iterations marked")
    rows, extras, counts = compact_trace(hook.final["entries"])
    stats = hook.final["memory_stats"]
    rec.update(initial=hook.initial, trace=rows, trace_extras=extras, trace_actions=counts,
               trace_truncated=len(rows) >= args.max_entries, recording=hook.how, cublas_cleared=hook.cublas_cleared,
               steps=hook.marks, final_segments=hook.marks[-1]["segments"], peaks=hook.final["peaks"],
               segment_counts={k: stats.get(k) for k in SEGMENT_COUNT_KEYS}, memory_stats=stats)
    try:
        rec["checks"] = trace_checks(rec)
    except Exception as exc:  # noqa: BLE001 - the recording itself is kept
        rec["checks"] = {"reserved_ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return rec


def trace_checks(rec: dict) -> dict:
    """Self-checks of a recorded case, from its rows alone: reserved bytes (initial segments plus segment_alloc
    less segment_free rows) at the end and at their peak against torch's counters, which holds exactly when the
    trace has every segment event; and the requested bytes (initial blocks' requests plus alloc less
    free_completed rows) at their peak against ``requested_bytes.all.peak`` where torch has it (informative)."""
    reserved = rec["initial"]["reserved"]
    peak_reserved = reserved
    requested = sum(b[2] or 0 for seg in rec["initial"]["segments"] for b in seg["blocks"]
                    if b[3] == "active_allocated")
    peak_requested = requested
    for action, _, size, _ in rec["trace"]:
        size = size or 0
        if action == "segment_alloc":
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif action == "segment_free":
            reserved -= size
        elif action == "alloc":
            requested += size
            peak_requested = max(peak_requested, requested)
        elif action == "free_completed":
            requested -= size
    p = rec["peaks"]
    return {"reserved_from_trace": reserved, "peak_reserved_from_trace": peak_reserved,
            "reserved_ok": reserved == p["memory_reserved"] and peak_reserved == p["max_memory_reserved"],
            "peak_requested_from_trace": peak_requested,
            "requested_bytes_peak": rec["memory_stats"].get("requested_bytes.all.peak")}


def destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        log(f"destroying the process group failed: {exc}")


def summary(rec: dict) -> str:
    if "error" in rec:
        return f"{rec['name']}: FAILED: {rec['error']}"
    if "skipped" in rec:
        return f"{rec['name']}: skipped: {rec['skipped']}"
    if "trace" not in rec:
        return (f"{rec['name']}: ran {rec['config']['steps']} step(s) without recording, {rec['seconds']:.1f} s; "
                f"built: {json.dumps(rec['built'])}")
    a = rec["trace_actions"]
    p = rec["peaks"]
    more = ", TRUNCATED (ring buffer full)" if rec["trace_truncated"] else ""
    more += "" if rec["checks"]["reserved_ok"] else ", reserved bytes from the trace DIFFER from torch's counters"
    streams = len({r[3] for r in rec["trace"]})
    return (f"{rec['name']}: {len(rec['trace'])} trace entries ({a.get('alloc', 0)} alloc, "
            f"{a.get('segment_alloc', 0)} segment_alloc, {streams} streams{more}), peak allocated "
            f"{p['max_memory_allocated'] / MIB:.1f} MiB, reserved {p['max_memory_reserved'] / MIB:.1f} MiB, "
            f"{len(rec['final_segments'])} segments, {rec['seconds']:.1f} s")


def write(doc: dict, path: Path) -> int:
    data = json.dumps(doc, separators=(",", ":")).encode()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(data)
    tmp.replace(path)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for allocator_traces.json.gz")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--budget-s", type=float, default=110.0, help="start no case after this many seconds "
                        "less the case's estimate (default 110)")
    parser.add_argument("--steps", type=int, default=3, help="iterations recorded per case (default 3)")
    parser.add_argument("--max-entries", type=int, default=400_000, help="torch's ring buffer of trace entries "
                        "per case (default 400000; a case that fills it is marked trace_truncated)")
    parser.add_argument("--dry", action="store_true", help="CPU: build every case, one step each, no recording")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("record_allocator_traces.py needs a CUDA GPU (or --dry for a CPU check of the script)")
        return 2
    cuda = not args.dry
    turned_off = ensure_no_expandable_segments() if cuda else False
    if cuda and allocator_backend() not in (None, "native"):
        print(f"record_allocator_traces.py needs torch's native caching allocator, not {allocator_backend()!r} "
              "(unset backend: in PYTORCH_CUDA_ALLOC_CONF)")
        return 2
    env = environment(cuda)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("allocator_traces_dry.json.gz" if args.dry else "allocator_traces.json.gz")
    doc: dict[str, Any] = {
        "format": "memfit.allocator_traces", "format_version": FORMAT_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)], "dry": args.dry,
        "env": env,
        "allocator": {"backend": allocator_backend() if cuda else None,
                      "env": {k: os.environ.get(k) for k in ALLOC_ENV}, "expandable_segments": False,
                      "expandable_segments_turned_off": turned_off, "recording": None,
                      "max_entries": args.max_entries},
        "trace_fields": list(TRACE_FIELDS), "block_fields": list(BLOCK_FIELDS), "cases": []}
    log(f"torch {env['torch']}, CUDA {env['cuda']}, {env.get('gpu') or 'CPU (--dry)'}; writing {path}")
    if args.dry:  # the serialisation on a snapshot shaped as torch documents it
        snap = synthetic_snapshot()
        rows, extras, counts = compact_trace(device_trace(snap, 0))
        segments = compact_segments(snap, 0)
        assert rows[1] == ["alloc", 0x7F0000000000, 100, 0] and extras == {"4": {"device_free": 4096}}, (rows, extras)
        assert counts["alloc"] == 1 and segments[0]["blocks"][0] == [0x7F0000000000, 512, 100, "active_allocated"]
        json.loads(json.dumps({"trace": rows, "extras": extras, "segments": segments}))
        doc["synthetic_check"] = {"trace": rows, "trace_extras": extras, "segments": segments}
    cases = [c for c in CASES if args.only in c.name]
    if not cases:
        print(f"no case's name contains {args.only!r}: {', '.join(c.name for c in CASES)}")
        return 2
    for case in cases:
        left = args.budget_s - (time.perf_counter() - T0)
        need = case.est_s / (3 if args.dry else 1)
        if left < need + RESERVE_S:
            rec = {"name": case.name, "skipped": f"time budget: {left:.0f} s left, the case needs about {need:.0f} s"}
        else:
            try:
                rec = run_case(case, args, env)
            except Exception as exc:  # noqa: BLE001 - one case's failure must not lose the others
                rec = {"name": case.name, "error": f"{type(exc).__name__}: {str(exc).strip()[:2000]}",
                       "traceback": traceback.format_exc()[-6000:]}
            finally:
                if case.strategy:
                    destroy_group()
        print(summary(rec), flush=True)
        if rec.get("recording"):
            doc["allocator"]["recording"] = rec["recording"]
        if any(s.get("is_expandable") for s in rec.get("final_segments", [])):
            doc["allocator"]["expandable_segments"] = True
        doc["cases"].append(rec)
        doc["seconds"] = round(time.perf_counter() - T0, 1)
        size = write(doc, path)
    ok = sum("error" not in r and "skipped" not in r for r in doc["cases"])
    done = "run" if args.dry else "recorded"
    print(f"{ok} of {len(doc['cases'])} cases {done} in {doc['seconds']:.0f} s; {path}: {size / MIB:.2f} MiB gzipped",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
