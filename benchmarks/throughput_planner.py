"""The planner's choice for benchmarks/gpu_throughput.py, made in a fresh process.

``memfit.planner.predict`` forks worker processes for its fake steps, and autograd refuses to run in a
child forked from a process that has run a backward (the benchmark has), so the prediction runs in a new
interpreter (``python throughput_planner.py IN OUT``, with no GPU visible: fake steps need none) while the
benchmark warms its other paths up. IN holds the pickled (config, target device, budget, compile allowed,
as_is); OUT receives the chosen plan, its predicted figures and the fastest predicted plans.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def start_prediction(cfg: dict, device: Any, budget: int, allow_compile: bool, as_is: bool,
                     tmp: str) -> subprocess.Popen:
    """Start predicting ``cfg``'s plans for ``device`` within ``budget`` bytes; :func:`finish_prediction` waits."""
    inp, out = Path(tmp) / "predict_in.pkl", Path(tmp) / "predict_out.pkl"
    inp.write_bytes(pickle.dumps((cfg, device, budget, allow_compile, as_is)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with open(Path(tmp) / "predict.log", "w") as log:
        return subprocess.Popen([sys.executable, __file__, str(inp), str(out)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def finish_prediction(proc: subprocess.Popen, tmp: str, timeout: float) -> dict:
    """The child's result (``plan``, ``facts``, ``plan_name``, predicted figures), or ``{'error': why}``."""
    try:
        proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": f"the prediction took longer than the {timeout:.0f} s left"}
    out = Path(tmp) / "predict_out.pkl"
    if proc.returncode != 0 or not out.exists():
        tail = (Path(tmp) / "predict.log").read_text().strip().splitlines()[-1:] or ["no output"]
        return {"error": f"the prediction failed: {tail[0]}"}
    return pickle.loads(out.read_bytes())


def choose(results: list, recommended: int | None, budget: int, allow_compile: bool) -> Any:
    """The recommended plan, unless it compiles and compiling is not allowed: then the fastest other plan
    within the budget less the planner's margin, as the recommendation is chosen."""
    from memfit.planner.predict import AUTO_FIT_MARGIN

    def allowed(r: Any) -> bool:
        return allow_compile or not getattr(r.plan, "compile", False)

    if recommended is not None and allowed(results[recommended]):
        return results[recommended]
    fitting = [r for r in results if r.peak_bytes <= budget * (1 - AUTO_FIT_MARGIN) and allowed(r)]
    return min(fitting, key=lambda r: (r.seconds, r.peak_bytes), default=None)


def _child(inp: str, out: str) -> None:
    from memfit.planner.fake import build_meta_model
    from memfit.planner.predict import predict
    from memfit.planner.space import ModelFacts

    cfg, device, budget, allow_compile, as_is = pickle.loads(Path(inp).read_bytes())
    kwargs = {"compile": allow_compile} if "compile" in inspect.signature(predict).parameters else {}
    start = time.perf_counter()
    pred = predict(cfg, device=device, budget=budget, as_is=as_is, **kwargs)
    seconds = time.perf_counter() - start
    pick = choose(pred.results, pred.recommended, budget, allow_compile)
    doc = pred.to_json()
    result: dict[str, Any] = {"budget_bytes": budget, "device": device.name, "predict_s": round(seconds, 2),
                              "notes": list(pred.notes), "plans_predicted": len(doc["plans"]),
                              "fastest_plans": doc["plans"][:12]}
    if pick is None:
        result["error"] = "no plan fits the budget"
    else:
        result.update(plan=pick.plan, plan_name=pick.plan.name, predicted_peak_bytes=pick.peak_bytes,
                      predicted_rel_step_time=round(pick.rel_step_time, 4),
                      facts=ModelFacts.of(build_meta_model(cfg["model"])))
    Path(out).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
