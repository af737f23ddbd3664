"""The file benchmarks/record_allocator_traces.py writes, and the functions that compact torch's snapshots into it.

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
dataset is ``RandomImages`` of benchmarks/throughput_paths.py), ``torch``, ``cuda``, ``gpu`` (repeated from
``env`` so a case stands alone), then

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
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

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
MIB = 2**20


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
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
        row = {k: jsonable(seg[k]) for k in SEGMENT_KEYS if k in seg}
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
        rows.append([jsonable(e.get(k)) for k in TRACE_FIELDS])
        counts[str(e.get("action"))] += 1
        more = {k: jsonable(v) for k, v in e.items()
                if k not in TRACE_FIELDS and k not in DROPPED_TRACE_KEYS and not (k == "pool_id" and _default_pool(v))}
        if more:
            extras[str(i)] = more
    return rows, extras, dict(counts)


def alloc_frames(entries: list[dict], min_size: int = MIB, keep: int = 6) -> dict[str, str]:
    """Each allocation of at least ``min_size`` bytes whose entry has Python frames: its row index (as a string) ->
    its innermost ``keep`` frames, ``dir/file.py:line:function`` joined by `` < `` (innermost first)."""
    out = {}
    for i, e in enumerate(entries):
        if e.get("action") != "alloc" or (e.get("size") or 0) < min_size or not e.get("frames"):
            continue
        out[str(i)] = " < ".join(
            f"{'/'.join(str(f.get('filename', '?')).split('/')[-2:])}:{f.get('line', 0)}:{f.get('name', '?')}"
            for f in e["frames"][:keep])
    return out


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


def synthetic_check() -> dict:
    """The serialisation on a snapshot shaped as torch documents it (``--dry``): the compacted rows, extras and
    segments, checked."""
    snap = synthetic_snapshot()
    rows, extras, counts = compact_trace(device_trace(snap, 0))
    segments = compact_segments(snap, 0)
    assert rows[1] == ["alloc", 0x7F0000000000, 100, 0] and extras == {"4": {"device_free": 4096}}, (rows, extras)
    assert counts["alloc"] == 1 and segments[0]["blocks"][0] == [0x7F0000000000, 512, 100, "active_allocated"]
    json.loads(json.dumps({"trace": rows, "extras": extras, "segments": segments}))
    return {"trace": rows, "trace_extras": extras, "segments": segments}


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


def write(doc: dict, path: Path) -> int:
    data = json.dumps(doc, separators=(",", ":")).encode()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(data)
    tmp.replace(path)
    return path.stat().st_size
