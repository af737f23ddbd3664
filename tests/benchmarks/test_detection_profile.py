"""benchmarks/detection_profile.py on the tiny DINO on a CPU: its parts table, and part markers that change
neither the losses nor the gradients and attribute the backward under activation checkpointing."""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "detection_profile.py"


def _script():
    if "detection_profile" not in sys.modules:
        spec = importlib.util.spec_from_file_location("detection_profile", SCRIPT)
        sys.modules["detection_profile"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["detection_profile"])
    return sys.modules["detection_profile"]


def test_parts_table_sums_to_the_step_and_finds_the_sampling(capsys):
    dp = _script()
    [row] = dp.main(["--tiny", "--device", "cpu", "--rows", "1", "--top", "5"])
    out = capsys.readouterr().out
    shares = {}
    for part in dp.PARTS:
        label = re.escape(dp.LABELS.get(part, part))
        found = re.search(rf"^\| {label} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+)% \|", out, re.M)
        assert found, f"no line for {part} in\n{out}"
        shares[part] = float(found.group(1))
    assert abs(sum(shares.values()) - 100) < 0.6, shares
    assert any(name.startswith("aten::grid_sampler") for name in row["found"]), row["found"]
    assert shares["sampling"] > 0 and shares["backbone"] > 0 and shares["optimizer"] > 0
    assert set(row["sampling_in"]) == {"encoder", "decoder"}, row["sampling_in"]
    assert row["parts"]["matching"][0] > 0 and row["matching_calls"] == 4  # 2 images x (decoder, encoder)
    assert "| top 5 operators" in out


def _loss_and_grads(model, wrapper, batch) -> tuple[dict, list]:
    torch.manual_seed(1)  # the denoising queries' draw
    with wrapper.optim_context(model):
        losses = model._run_forward(model.data_preprocessor(batch, True), mode="loss")
    loss, _ = model.parse_losses(losses)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in losses.items()}, grads


def test_markers_change_nothing_and_attribute_the_checkpointed_backward():
    from memfit.data import write_shapes_coco
    from memfit.planner.inputs import Inputs

    dp = _script()
    with tempfile.TemporaryDirectory() as tmp:
        write_shapes_coco(tmp, num=2, image_size=96, split="train")
        cfg, switches = dp.row_cfg(5, Path(tmp), tiny=True)
        assert switches == "gc_backbone+gc_encoder"
        model, wrapper, _ = dp.build(cfg, "cpu")
        batch = Inputs(cfg).batch()
    plain = _loss_and_grads(model, wrapper, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof, dp.part_markers(model, wrapper, lambda: None):
        marked = _loss_and_grads(model, wrapper, batch)
    assert plain[0].keys() == marked[0].keys()
    assert all(torch.equal(plain[0][k], marked[0][k]) for k in plain[0])
    assert len(plain[1]) == len(marked[1]) and all(torch.equal(a, b) for a, b in zip(*(plain[1], marked[1])))
    assert "loss" not in vars(model.bbox_head) and "step" not in vars(wrapper)  # the markers are undone
    parts = dp.attribute(prof.events(), cuda=False, steps=1)["parts"]
    for part in ("backbone", "encoder", "decoder", "sampling", "losses"):  # backward (with the recompute)
        assert parts[part][1] > 0, (part, parts)
    total = sum(f + b for f, b in parts.values())
    assert sum(parts["other"]) < 0.2 * total, parts
