"""DumpResults: MMEngine's metric that writes the predictions of a test (or validation) run to a file."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit import dist
from memfit.errors import ConfigError, ConfigTypeError
from memfit.evaluator.metric import BaseMetric, batch_len, take_samples
from memfit.logger import LOGGER_NAME
from memfit.registry import METRICS

_PICKLE = (".pkl", ".pickle")
_TORCH = (".pth", ".pt")


@METRICS.register()
class DumpResults(BaseMetric):
    """``dict(type='DumpResults', out_file_path='results.pkl')`` in ``test_evaluator``: the predictions.

    The file holds a list with one entry per sample, in dataset order (gathered from every rank, the
    distributed sampler's padding removed): the model's ``predict`` output for that sample, cut out
    of the batch (``(scores, labels)`` -> ``(scores[i], labels[i])``; a list of per-sample items ->
    its i-th item), as plain data: CPU tensors, dicts, lists, tuples, numbers, strings (an object
    with ``to_dict()``, such as a data sample, is stored as that dict). ``.pkl``/``.pickle`` is
    written with ``pickle`` as MMEngine does (read it with ``pickle.load`` or ``mmengine.load``, only
    from a source you trust); ``.pth``/``.pt`` with ``torch.save``, which ``torch.load(path,
    weights_only=True)`` reads without running any code. Returns no metrics. ``collect_dir`` is
    accepted for MMEngine's signature; results are gathered through the process group.
    """

    def __init__(self, out_file_path: str | Path, collect_device: str = "cpu", collect_dir: str | None = None) -> None:
        super().__init__(collect_device=collect_device)
        if not isinstance(out_file_path, str | Path) or not str(out_file_path).endswith(_PICKLE + _TORCH):
            raise ConfigError(f"DumpResults.out_file_path={out_file_path!r}: use a file name ending in .pkl or "
                              ".pickle (a pickle, as MMEngine) or .pth/.pt (torch.save, loads with weights_only)")
        self.out_file_path = str(out_file_path)

    def process(self, data_batch: Any, data_samples: Any) -> None:
        """Append one plain-data entry per sample of the batch."""
        if isinstance(data_samples, list | tuple) and data_samples and not isinstance(data_samples[0], torch.Tensor):
            n: int | None = len(data_samples)  # already one item per sample (data samples, dicts)
        else:
            n = batch_len(data_batch, data_samples)
        samples = [data_samples] if n is None else [take_samples(data_samples, n, i) for i in range(n)]
        self.results.extend(_plain(s, f"[{len(self.results) + i}]") for i, s in enumerate(samples))

    def compute_metrics(self, results: list) -> dict:
        """Write ``results`` (every rank's, in sample order) on the main process; no metrics."""
        if dist.is_main_process():
            from memfit.checkpoint import atomic_path

            path = Path(self.out_file_path)
            with atomic_path(path) as tmp:
                if path.name.endswith(_PICKLE):
                    with open(tmp, "wb") as f:
                        pickle.dump(results, f, protocol=pickle.HIGHEST_PROTOCOL)
                else:
                    torch.save(results, tmp)
            logging.getLogger(LOGGER_NAME).info(f"Results has been saved to {self.out_file_path}.")
        return {}


def _plain(obj: Any, where: str) -> Any:
    """``obj`` as CPU tensors and plain containers; a value of another kind is an error naming where it is."""
    if isinstance(obj, torch.Tensor):
        # A copy of its own: a view keeps (and would write) the storage of the whole batch.
        return obj.detach().as_subclass(torch.Tensor).cpu().clone()
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        obj = obj.to_dict()
    if isinstance(obj, dict):
        return {k if type(k) in (str, int) else str(k): _plain(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise ConfigTypeError(f"DumpResults: the prediction value at {where!r} is a {type(obj).__name__}, which the "
                          "dump cannot hold as plain data: return tensors, numbers, strings, lists or dicts from "
                          "predict (or an object with to_dict())")
