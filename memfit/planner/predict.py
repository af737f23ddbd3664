"""Predict every plan's per-rank peak memory and relative step time from a few fake steps.

Running the whole step for each of hundreds of plans would take minutes on a large model; the
planner runs three kinds of fake step and composes them:

1. the configured plan, as it is (one optimizer step, its state added to the next forward/backward,
   as :func:`memfit.planner.fake.measure_step` does with ``steps=1``): its row is measured, not composed;
2. one full step per sharding (none/DDP, ZeRO-1, ZeRO-2, FSDP, FSDP + CPU offload) at the
   reference activations (fp32, no checkpointing, no Conv-BN folding, the configured micro-batch):
   the model state, the optimizer phase's peak and the communication of each sharding;
3. one recorded forward/backward without checkpointing per precision (fp32/half) x Conv-BN choice, in a
   single process, at the configured micro-batch and half of it; each checkpointing choice's step is
   composed from it (:mod:`memfit.planner.recompute`), not run.

A plan's forward/backward peak is its sharding's (2) plus how much its activations differ from the
reference's (3); its optimizer-phase peak is its sharding's; its peak is the larger. Activation
differences are additive across the model state because the state is the same tensors either way;
a smaller micro-batch scales the difference by how the reference's batch-dependent bytes scale
(exact for models whose activations are linear in the batch). fp16 and bf16 hold the same bytes.
The recommended plan is then run whole (1) and replaced by its measurement before it is trusted.

Every enumerated plan has the speed levers the target and the model allow (:mod:`memfit.planner.levers`):
channels_last and a fused optimizer run in the fake steps (a plan's sharding and activation steps are run with
its levers); TF32, cuDNN's benchmark and compile are left out of them and priced by the time model. Compiled
twins of the plans are listed only when asked for (``compile``), each with its eager plan's memory.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

from memfit.errors import ConfigError
from memfit.planner.block_subsets import block_subsets
from memfit.planner.compose_all import compose_all
from memfit.planner.composer import Composer
from memfit.planner.devices import Device
from memfit.planner.fake import build_meta_model
from memfit.planner.inputs import Inputs
from memfit.planner.levers import Levers, allowed_levers, compiled_twins
from memfit.planner.results import AUTO_FIT_MARGIN, PlanResult, Prediction, fit_margin, plan_result
from memfit.planner.runs import Runs, StepFailed, workers
from memfit.planner.space import PRECISIONS, ModelFacts, Plan, configured_plan, enumerate_plans


def predict(cfg: dict, *, device: Device, world_size: int = 1, budget: int | None = None, as_is: bool = False,
            progress: bool = False, verify: bool = True, inputs: Inputs | None = None, compile: bool = False,
            also: Sequence[Plan] = ()) -> Prediction:
    """Predict the plans of ``cfg`` at ``world_size`` ranks on ``device`` (see the module docstring).

    ``as_is``: only the configured plan. ``compile``: list compiled twins of the plans too (also when the
    config compiles); their memory is their eager plan's. ``also``: plans to predict besides the enumerated
    ones (``memfit bench --plans``). ``budget`` (bytes per rank, default the device's memory)
    decides ``fits`` and the recommendation: the fastest plan within ``budget`` less 5%, verified by a
    whole fake step when ``verify``. Every step runs on the largest batch the train pipeline can make
    (``inputs``, default :class:`~memfit.planner.inputs.Inputs` of ``cfg``).
    """
    start = time.perf_counter()
    budget = budget or device.memory
    if "train_dataloader" not in cfg or "optim_wrapper" not in cfg:
        raise ConfigError("the planner needs train_dataloader and optim_wrapper in the config (it runs the train step)")
    log = logging.getLogger("memfit")
    level = log.level
    log.setLevel(logging.ERROR)  # techniques log each module they touch, precisions their CPU caveats
    try:
        with warnings.catch_warnings():  # FSDP's view-output and autocast notes, once per fake step
            warnings.simplefilter("ignore", UserWarning)
            return _predict(cfg, device, world_size, budget, as_is, progress, verify, start, inputs, compile, also)
    finally:
        log.setLevel(level)


def on_target(cfg: dict, device: Device) -> dict:
    """``cfg`` as its steps run on ``device``: on CUDA, torch's optimizers default to their ``foreach``
    implementation (CPU tensors, which the fake step runs, default to the per-tensor loop). foreach holds
    a parameter-sized temporary while it steps, and is one operator per list, not per tensor."""
    import inspect

    from memfit.registry import OPTIMIZERS

    ow = cfg.get("optim_wrapper")
    opt = ow.get("optimizer") if isinstance(ow, dict) else None
    if not device.cuda or not isinstance(opt, dict) or "foreach" in opt or opt.get("fused"):
        return cfg
    kind = opt.get("type")
    try:
        target = OPTIMIZERS.get(kind) if isinstance(kind, str) else kind
        takes = "foreach" in inspect.signature(target).parameters
    except (ConfigError, KeyError, TypeError, ValueError):
        return cfg
    if not takes:
        return cfg
    return {**cfg, "optim_wrapper": {**ow, "optimizer": {**opt, "foreach": True}}}


def _predict(cfg: dict, device: Device, world_size: int, budget: int, as_is: bool, progress: bool, verify: bool,
             start: float, inputs: Inputs | None, compile: bool, also: Sequence[Plan]) -> Prediction:
    cfg = on_target(cfg, device)
    meta = build_meta_model(cfg["model"])
    facts = ModelFacts.of(meta)
    configured = configured_plan(cfg, facts, device.cuda)
    inputs = inputs or Inputs(cfg)
    levers = allowed_levers(cfg, facts, device, inputs.fixed_size, compile or configured.compile)
    precisions = tuple(p for p in PRECISIONS if device.dtype_tflops(p))
    enumerated = [] if as_is else enumerate_plans(configured, facts, world_size, precisions, device.cuda)
    plans = [levers.on(p) for p in enumerated]
    plans = list(dict.fromkeys([*plans, *(replace(p, configured=False) for p in also)]))
    if levers.compile:
        plans += compiled_twins(plans)
    plans = [p for p in dict.fromkeys(plans) if p != configured]
    ref = Plan("fp32", "none", "none", "none", False, configured.micro_batch, configured.accumulative_counts)
    micro = sorted({p.micro_batch for p in plans} - {configured.micro_batch})
    with Runs(cfg, facts, meta, world_size, progress, device.sms if device.cuda else None, inputs) as runs:
        compose = Composer(runs, ref, device, world_size, micro, levers)
        runs.collecting = True  # first pass: which fake steps the composition needs; then run them all at once
        runs.run("configured", configured, full=True, steps=1)
        compose.configured_fb(configured)
        for p in plans:
            compose(p)
        runs.collecting = False
        runs.execute()
        try:
            own = runs.run("configured", configured, full=True, steps=1)
            # Compute comes from a forward/backward run, as for every composed row (clipping and loss scaling,
            # which a whole step also runs, are outside the model's operators for all rows alike).
            own_fb = compose.configured_fb(configured)
        except StepFailed as exc:
            raise ConfigError(f"the configured plan ({configured.name}) fails in its fake step: {exc}") from None
        results = [plan_result(configured, own, own_fb, device, world_size, configured.accumulative_counts, "measured")]
        failed: dict[str, list[Plan]] = {}
        for p, row in compose_all(compose, plans, workers()):
            if isinstance(row, StepFailed):
                failed.setdefault(str(row), []).append(p)
            else:
                results.append(row)
        results += block_subsets(results, len(facts.blocks), budget, compose, workers())
        planned = inputs.planned(configured.micro_batch)
        detection = planned.boxes_per_image is not None
        _rank(results, budget, device, detection)
        recommended = _recommend(results, budget)
        if verify:
            _verify_ahead(runs, results, budget, recommended)
        while verify and recommended is not None and results[recommended].source != "measured":
            r = results[recommended]
            try:
                m = runs.run(("verify", r.plan), r.plan, full=True, steps=1)
                measured = plan_result(r.plan, m, m, device, world_size, r.plan.accumulative_counts, "measured")
                results[recommended] = replace(measured, seconds=r.seconds, time=r.time)
            except StepFailed as exc:
                failed.setdefault(str(exc), []).append(results.pop(recommended).plan)
            _rank(results, budget, device, detection)
            recommended = _recommend(results, budget)
        order = sorted(range(len(results)), key=lambda i: (results[i].seconds, results[i].peak_bytes))
        index = {old: new for new, old in enumerate(order)}
        notes = [f"{len(ps)} plan(s) left out, their fake step fails ({', '.join(p.name for p in ps[:3])}"
                 f"{', ...' if len(ps) > 3 else ''}): {why}" for why, ps in failed.items()]
        notes += _stand_in_note(cfg, world_size, configured)
        if recommended is not None:
            notes += _host_note(results[recommended], levers)
        return Prediction(device, world_size, budget, [results[i] for i in order],
                          index.get(recommended) if recommended is not None else None, time.perf_counter() - start,
                          notes=notes, fake_steps=len(runs.cache), input=planned,
                          levers=levers)


def _host_note(r: PlanResult, levers: Levers) -> list[str]:
    """A line when the recommended plan's step is paced by the host: a faster GPU would not make it faster."""
    if r.time is None or r.time.bound != "host" or r.plan.compile:
        return []
    idle = 1 - r.time.kernels / r.time.host
    how = "a compiled plan launches" if levers.compile else "compiled plans (--compile) launch"
    return [f"the recommended plan is paced by the host: its GPU waits for Python to launch kernels, idle {idle:.0%} "
            f"of the step; {how} fewer kernels"]


def _stand_in_note(cfg: dict, world_size: int, configured: Plan) -> list[str]:
    """A line when the configured strategy's own engine cannot run on fake tensors (DeepSpeed, colossalai)."""
    from memfit.strategies import build_strategy

    strategy = build_strategy(copy.deepcopy(cfg.get("strategy")), world_size)
    if strategy.capabilities.fake_step:
        return []
    return [f"the configured {type(strategy).__name__} runs its own engine, which fake tensors cannot: its row is "
            f"the FSDP2/ZeRO-1 step of the same sharding ({configured.sharding}), an estimate of the engine's memory"]


def _rank(results: list[PlanResult], budget: int, device: Device, detection: bool = False) -> None:
    base = results[0].seconds or 1.0
    for r in results:
        r.rel_step_time = r.seconds / base
        r.fits = r.peak_bytes <= budget * (1 - fit_margin(r, device, detection))


def _verify_ahead(runs: Runs, results: list[PlanResult], budget: int, recommended: int | None) -> None:
    """Run the recommended plan's verification beside those of the plans that would follow it should each be found
    over the budget, one per worker, at once: a recommendation whose verification fails (DINO's first, a pyramid's
    composed row) then costs no second wait. Their results stay in ``runs``' cache for the verification loop. Not
    where steps run in this process (no fork, or a backward ran here first): one after the other, they would."""
    if not runs.forked:
        return
    rest, plans = list(results), []
    while recommended is not None and len(plans) < workers():
        r = rest.pop(recommended)
        if r.source == "measured":  # its own fake step already: the verification would stop here
            break
        plans.append(r.plan)
        recommended = _recommend(rest, budget)
    if len(plans) < 2:
        return
    runs.collecting = True
    try:
        for plan in plans:
            try:
                runs.run(("verify", plan), plan, full=True, steps=1)
            except StepFailed:  # already run, and failed: the loop leaves it out
                pass
    finally:
        runs.collecting = False
    runs.execute()


def _recommend(results: list[PlanResult], budget: int) -> int | None:
    limit = budget * (1 - AUTO_FIT_MARGIN)
    fitting = [i for i, r in enumerate(results) if r.peak_bytes <= limit and r.fits]
    return min(fitting, key=lambda i: (results[i].seconds, results[i].peak_bytes)) if fitting else None
