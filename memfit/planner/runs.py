"""The fake steps a prediction needs: collected first, then run once each, in parallel processes.

The composer asks for runs by key; in the collecting pass it gets placeholders and the keys are
recorded, so the composition code alone decides which steps are needed. The recorded steps then run
in worker processes (one per CPU core, at most 4): each is a single-threaded Python walk over fake
tensors, so they scale with cores. Workers are forked with the meta model already built, join a
fake process group of their own and stay for the prediction (:mod:`memfit.planner.pool`), so the
recommended plan's verification runs in a worker whose caches are warm for it.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import sys
from typing import Any

import torch

from memfit.errors import ConfigError, first_line
from memfit.optim.spec import OptimWrapperSpec
from memfit.planner.fake import Phase, StepMeasurement, fake_process_group, measure_step, measured_optim_wrapper
from memfit.planner.host_step import optimizer_step
from memfit.planner.inputs import Inputs
from memfit.planner.kernel_scratch import H100_SMS
from memfit.planner.levers import fake_step_cfg
from memfit.planner.pool import Job, Pool, WorkerStuck
from memfit.planner.space import ModelFacts, Plan, technique_cfg
from memfit.planner.sync_points import SYNC_ONLY
from memfit.strategies import capabilities_of, fake_step_config, fake_step_strategy

_WORKER: dict[str, Any] = {}  # the forked worker's meta model and batches (memfit.planner.inputs.Inputs)


def _init_worker(world_size: int) -> None:
    import logging
    import warnings

    torch.set_num_threads(1)
    # A child forked from a process that has used CUDA (bench, auto-fit on a GPU; torch.cuda.is_available
    # alone poisons forks) fails at its first CUDA call. Fake steps run on CPU tensors and need no GPU,
    # but a strategy's setup asks which device to use: this worker sees none.
    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0
    logging.getLogger("memfit").setLevel(logging.ERROR)
    warnings.simplefilter("ignore", UserWarning)
    group = fake_process_group(world_size)
    group.__enter__()  # held for the worker's life
    _WORKER["group"] = group


class StepFailed(Exception):
    """A plan's fake step raised (the plan cannot train as configured, e.g. selective checkpointing over
    an in-place op): the plans that need it are left out, with the reason. Picklable (a message)."""


def _forked_autograd(exc: BaseException) -> bool:
    """Autograd refuses to run backward in a child forked after this process ran one."""
    return isinstance(exc, RuntimeError) and "fork" in str(exc)


def _run_one(cfg: dict, full: bool, steps: int, cuda: tuple[int, int] | None,
             record: tuple[str, ...] | None = None, optimizer_only: bool = False) -> StepMeasurement | StepFailed:
    """The fake step (``cuda``: the target GPU's SMs and threads per SM; None: a CPU target; ``optimizer_only``: its
    optimizer's step alone, :func:`~memfit.planner.host_step.optimizer_step`), or why it failed (returned, so that
    the cache keeps it beside the measurements)."""
    batch = None if optimizer_only else _WORKER["inputs"].batch(cfg["train_dataloader"]["batch_size"])
    try:
        if optimizer_only:
            return optimizer_step(cfg, _WORKER["meta"])
        return measure_step(cfg, full=full, batch=batch, meta_model=_WORKER["meta"], steps=steps,
                            cuda=cuda is not None, record=record, sms=cuda or H100_SMS)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the step's own error, whatever it is, says why the plan cannot run
        if _forked_autograd(exc):
            raise  # not the plan's: autograd cannot run in this forked worker, so the runs move in-process
        return StepFailed(f"{type(exc).__name__}: {first_line(exc)}")


def workers() -> int:
    """Processes to run fake steps in: the cores this process may use, at most 4 (MEMFIT_PLAN_WORKERS)."""
    if "MEMFIT_PLAN_WORKERS" in os.environ:
        return max(1, int(os.environ["MEMFIT_PLAN_WORKERS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))


def _canonical(cfg: dict, full: bool, steps: int, record: tuple[str, ...] | None = None,
               optimizer_only: bool = False) -> str:
    """What a fake step of ``cfg`` runs, as a string: two configs that differ only in how they say the same
    thing (fp16 for bf16, which the fake step measures alike; FSDP's defaults written out or not; the
    technique switches at the top level or under ``cfg``; accumulation a forward/backward run overrides; how
    the optimizer steps (``foreach``, ``fused``) in a forward/backward run, which takes no step; FSDP's CPU
    offload, a no-op on CPU tensors) run the same step, once. Unsure cases stay apart (live objects compare by
    identity)."""
    from memfit.config.schema import TECHNIQUE_KEYS

    c = copy.copy(cfg)
    techniques = {k: v for k, v in technique_cfg(c).items() if v}
    for key in ("cfg", *TECHNIQUE_KEYS):
        c.pop(key, None)
    c["cfg"] = techniques
    ow = measured_optim_wrapper(c.get("optim_wrapper"), full)
    if isinstance(ow, dict):
        c["optim_wrapper"] = {"accumulative_counts": 1, **ow}
        if not full and isinstance(ow.get("optimizer"), dict):
            opt = ow["optimizer"]
            c["optim_wrapper"]["optimizer"] = {k: v for k, v in opt.items() if k not in ("foreach", "fused")}
    c["strategy"] = fake_step_config(c.get("strategy"))  # no strategy key is None: the runner's default either way
    return json.dumps([c, full, steps if full else 1, record, *(["optimizer only"] if optimizer_only else [])],
                      sort_keys=True, default=repr)


def _fsdp(cfg: dict) -> bool:
    """The step shards gradients at least (FSDP2: DTensors, a wrapping pass)."""
    strategy = cfg.get("strategy")
    return strategy is not None and _sharding(json.dumps(strategy, sort_keys=True, default=repr), strategy)


_SHARDING: dict[str, bool] = {}


def _sharding(key: str, strategy: Any) -> bool:
    if key not in _SHARDING:
        _SHARDING[key] = capabilities_of(strategy).sharding in ("zero2", "fsdp")
    return _SHARDING[key]


def _cost(cfg: dict, full: bool, steps: int, record: tuple[str, ...] | None = None,
          optimizer_only: bool = False) -> float:
    """A fake step's run time in forward/backward runs, for ordering (fitted on DINO Swin-L's steps): each
    micro-step one, each optimizer step 0.4, FSDP's wrapping 0.5, a recorded forward/backward 1.2 (one recording
    only its sync points, ``SYNC_ONLY``: as one not recorded)."""
    if optimizer_only:
        return 0.4
    if not full:
        return 1.2 if record is not None and record[:1] != (SYNC_ONLY,) else 1.0
    counts = OptimWrapperSpec.of(cfg.get("optim_wrapper")).accumulative_counts
    return steps * (counts + 0.4) + 0.5 * _fsdp(cfg)


def _kinds(cfg: dict, full: bool) -> dict[Any, float]:
    """The caches a step warms in a worker, each with its cold cost in fake forward/backward steps
    (:mod:`memfit.planner.pool`): FakeTensorMode's per precision and micro-batch, DTensor's under FSDP."""
    ow = cfg.get("optim_wrapper")
    dtype = ow.get("dtype") if isinstance(ow, dict) else None
    kinds: dict[Any, float] = {("shapes", str(dtype), cfg["train_dataloader"]["batch_size"]): 0.25}
    if full and _fsdp(cfg):
        kinds["dtensor"] = 2.5
    return kinds


class Runs:
    """Fake steps, run once per distinct step (:func:`_canonical`) and cached. ``collecting``:
    :meth:`run` records the step and returns a placeholder."""

    def __init__(self, cfg: dict, facts: ModelFacts, meta: Any, world_size: int, progress: bool,
                 cuda: tuple[int, int] | None = None, inputs: Inputs | None = None) -> None:
        self.cfg, self.facts, self.meta, self.world, self.cuda = cfg, facts, meta, world_size, cuda
        self.inputs = inputs or Inputs(cfg)  # the batch each step runs on, at each micro-batch
        self.canon: dict[Any, str] = {}  # a caller's key -> the step it names
        self.cache: dict[str, StepMeasurement | StepFailed] = {}
        self.pending: dict[str, tuple[dict, bool, int, str, tuple[str, ...] | None]] = {}
        self.collecting = False
        self.progress = progress
        self.pool: Pool | None = None
        # Workers are forked while this process has run no backward (autograd's threads would not survive the
        # fork): False once a worker found otherwise or got stuck, or where fork does not exist; then steps run here.
        self.forked = "fork" in multiprocessing.get_all_start_methods()

    def _cfg(self, plan: Plan, single: bool) -> dict:
        cfg = fake_step_cfg(plan.apply(self.cfg, self.facts))
        cfg["strategy"] = dict(type="SingleDeviceStrategy") if single else fake_step_strategy(cfg.get("strategy"),
                                                                                               self.world)
        return cfg

    def run(self, key: Any, plan: Plan, full: bool, single: bool = False, steps: int = 2,
            record: tuple[str, ...] | None = None, optimizer_only: bool = False) -> StepMeasurement:
        """The fake step of ``plan`` (``full``: ``steps`` optimizer steps, else one forward/backward;
        ``single``: in one process; ``record``: a forward/backward's timeline, over these regions, see
        :mod:`memfit.planner.timeline`); ``key`` names it for the caller. Raises :class:`StepFailed`."""
        if key not in self.canon:
            cfg = self._cfg(plan, single)
            self.canon[key] = _canonical(cfg, full, steps, record, optimizer_only)
            if self.canon[key] not in self.cache and self.canon[key] not in self.pending:
                self.pending[self.canon[key]] = (cfg, full, steps, plan.name, record, optimizer_only)
        canon = self.canon[key]
        if canon not in self.cache:
            if self.collecting:
                return StepMeasurement(0, {}, Phase(), Phase())
            self.execute()
        out = self.cache[canon]
        if isinstance(out, StepFailed):
            raise out
        return out

    def _in_workers(self, pending: dict, bar: Any) -> None:
        if self.pool is None:  # forked with _WORKER's meta model
            self.pool = Pool(min(workers(), len(pending)), _init_worker, (self.world,))
        jobs = {key: Job(_run_one, (cfg, full, steps, self.cuda, record, only), _cost(cfg, full, steps, record, only),
                         _kinds(cfg, full)) for key, (cfg, full, steps, _, record, only) in pending.items()}

        def done(key: str, ok: bool, value: Any) -> bool:
            if not ok:
                if not _forked_autograd(value):
                    raise value
                self.forked = False  # this process ran a backward before forking: the rest runs here
                return False
            self.cache[key] = value
            if bar is not None:
                bar.update(1)
            return True

        try:
            self.pool.run(jobs, done)
        except WorkerStuck as exc:  # a hazard of forking this process (a lock or thread it held): the rest runs here
            print(exc, file=sys.stderr, flush=True)
            self.forked = False

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`execute` starts new ones)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def execute(self) -> None:
        """Run every pending step (in worker processes when there are several), with a progress bar."""
        pending, self.pending = self.pending, {}
        if not pending:
            return
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="memfit plan", unit="step", leave=False, file=sys.stderr)
        _WORKER["meta"], _WORKER["inputs"] = self.meta, self.inputs  # inherited by forked workers
        for cfg, *_ in pending.values():  # built here once, not in each worker
            self.inputs.batch(cfg["train_dataloader"]["batch_size"])
        try:
            if self.forked and (self.pool is not None or min(workers(), len(pending)) > 1):
                try:
                    self._in_workers(pending, bar)
                except BaseException:
                    self.close()
                    raise
                if not self.forked:
                    self.close()
            if all(key in self.cache for key in pending):
                return
            with fake_process_group(self.world):
                for key, (cfg, full, steps, name, record, only) in pending.items():
                    if key in self.cache:
                        continue
                    if bar is not None:
                        bar.set_postfix_str(name)
                    self.cache[key] = _run_one(cfg, full, steps, self.cuda, record, only)
                    if bar is not None:
                        bar.update(1)
        finally:
            _WORKER.pop("meta", None)
            _WORKER.pop("inputs", None)
            if bar is not None:
                bar.close()
