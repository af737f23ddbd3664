"""Checkpointing choices composed from one recorded forward/backward (memfit/planner/recompute.py) against
running each choice: the tracked peak, the simulated CUDA allocator's allocated and reserved peaks, FLOPs and
bytes written are the measured ones; operator counts within 5% (autograd's detaches of unpacked tensors)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.config import Config
from memfit.model import BaseModel
from memfit.planner.devices import gpu
from memfit.planner.fake import build_meta_model, fake_process_group, first_batch, measure_step
from memfit.planner.predict import predict
from memfit.planner.recompute import compose
from memfit.planner.space import ModelFacts, Plan, checkpointed_modules
from memfit.testing import shapes_detection_batch

DINO = Path(__file__).parents[1] / "fixtures" / "detection" / "dino_tiny.py"
SLACK = 1024  # bytes: autocast's casts may free a few hundred bytes in another order in the recomputation
SMALL_SEGMENT = 2 * 2**20  # the caching allocator's segment for small blocks


def _cfg(model, image: int = 32, batch: int = 2, precision: str = "fp32") -> dict:
    wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.01))
    if precision == "bf16":
        wrapper.update(type="AmpOptimWrapper", dtype="bfloat16")
    data = dict(type="ShapesDataset", image_size=image, num_classes=4, num_samples=8)
    loader = dict(batch_size=batch, num_workers=0, dataset=data, sampler=dict(type="DefaultSampler"))
    return dict(model=model, optim_wrapper=wrapper, train_dataloader=loader)


VIT = dict(type="TimmClassifier", model_name="vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8,
           embed_dim=64, depth=3, num_heads=2, drop_path_rate=0.0)
SWIN = dict(type="TimmClassifier", model_name="swin_tiny_patch4_window7_224", num_classes=4, img_size=64,
            embed_dim=32, depths=(2, 2), num_heads=(2, 4), drop_path_rate=0.0)


def _compare(cfg: dict, batch, choices: tuple[str, ...]) -> None:
    meta = build_meta_model(cfg["model"])
    facts = ModelFacts.of(meta)
    names = {c: checkpointed_modules(meta, facts, c) for c in choices}
    record = tuple(sorted({*facts.blocks, *(n for ns in names.values() for n in ns)}))
    precision = "bf16" if cfg["optim_wrapper"]["type"] == "AmpOptimWrapper" else "fp32"
    mb = cfg["train_dataloader"]["batch_size"]
    with fake_process_group(1):
        def run(choice: str, **kw):
            c = Plan(precision, choice, micro_batch=mb).apply(cfg, facts)
            c["strategy"] = dict(type="SingleDeviceStrategy")
            return measure_step(c, full=False, batch=batch, meta_model=meta, cuda=True, **kw)

        timeline = run("none", record=record).timeline
        for choice in ("none", *choices):
            measured = run(choice)
            composed = compose(timeline, names.get(choice, ()), selective=choice == "selective")
            what = f"{choice}: measured {measured.peak}, composed {composed.peak}"
            assert abs(composed.peak - measured.peak) <= SLACK, what
            assert abs(composed.cuda_allocated - measured.cuda_allocated) <= SLACK, what
            assert composed.cuda_reserved == measured.cuda_reserved, what
            assert (composed.flops, composed.written) == (measured.flops, measured.written), what
            assert composed.peak_without_grads == measured.peak_without_grads, what
            assert composed.ops == pytest.approx(measured.ops, rel=0.05), what
            if choice == "blocks":  # it is a different step: recomputation costs FLOPs and saves memory
                assert composed.flops > compose(timeline, ()).flops
                assert composed.peak < compose(timeline, ()).peak


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_vit_choices_compose_as_they_run(precision):
    cfg = _cfg(VIT, batch=16, precision=precision)
    _compare(cfg, first_batch(cfg["train_dataloader"]), ("blocks", "every2", "first2", "selective"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_swin_stages_and_blocks_compose_as_they_run(precision):
    cfg = _cfg(SWIN, image=64, batch=8, precision=precision)
    _compare(cfg, first_batch(cfg["train_dataloader"]), ("stages", "blocks", "every2", "first1", "selective"))


def test_dino_encoder_decoder_and_backbone_choices_compose_as_they_run():
    """Swin blocks, deformable attention (a custom autograd Function that recomputes in its backward), FFNs
    and whole encoder/decoder layers called with keyword tensors (query_pos, reference points)."""
    model = copy.deepcopy(Config.fromfile(DINO).to_dict()["model"])
    cfg = _cfg(model, image=64)
    _compare(cfg, shapes_detection_batch([0, 1]), ("stages", "blocks", "every2", "selective"))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, *, pos: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x + pos)))


class _KeywordNet(BaseModel):
    """Blocks take a large keyword tensor that only they use: a checkpoint frame keeps it alive until the
    block's backward, after the program dropped it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.pos = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x, y=None, mode="tensor"):
        for block in self.blocks:
            x = block(x, pos=self.pos(x).relu())
        out = self.head(x).sum(1)
        return {"loss": F.cross_entropy(out, y)} if mode == "loss" else out


def test_keyword_inputs_stay_with_the_checkpoint_frame():
    cfg = dict(model=_KeywordNet(), optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
               train_dataloader=dict(batch_size=8))
    _compare(cfg, (torch.randn(8, 16, 64), torch.randint(0, 4, (8,))), ("blocks", "every2", "selective"))


def test_the_planner_composes_what_it_used_to_run(tiny_config, tmp_path, monkeypatch):
    """Every plan of the tiny ViT: the same rows with the choices composed as with each one run, from fewer
    fake steps (one recorded forward/backward per precision replaces a step per checkpointing choice)."""
    cfg = Config.fromfile(str(tiny_config(tmp_path))).to_dict()
    rows = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MEMFIT_PLAN_COMPOSE_AC", flag)
        p = predict(cfg, device=gpu("4090"), world_size=2, verify=False)
        rows[flag] = ({r.plan.name: r for r in p.results}, p.fake_steps)
    (run, run_steps), (composed, composed_steps) = rows["0"], rows["1"]
    assert composed_steps < run_steps
    assert set(run) == set(composed)
    for name, r in run.items():
        c = composed[name]
        # A composed ZeRO-2 or FSDP row's peak comes from its sharding's bytes at each sync point, which a run
        # choice's step has not got (tests/planner/test_sync_points.py checks them against their own steps).
        sharded = c.plan.sharding in ("zero2", "fsdp") and c.plan.accumulative_counts == 1
        assert abs(c.allocated - r.allocated) <= (r.allocated * 0.001 if sharded else SLACK), name
        # Reserved comes from two simulated steps of each (composed from the timeline, or the run's own calls):
        # retroactive inputs enter the allocator at another point, and small blocks may tie otherwise.
        assert abs(c.peak_bytes - r.peak_bytes) <= SMALL_SEGMENT, name
        # The tiny model's steps are host-bound on a GPU (its operators set the time): the configured row's operators,
        # recorded or run, differ by 2% in its seconds (each checkpointed row's by under 1%).
        assert c.rel_step_time == pytest.approx(r.rel_step_time, rel=0.04), name


def test_a_model_with_its_own_checkpointing_runs_every_choice(tmp_path, monkeypatch):
    """Its recording would miss what its own checkpoints save: the planner runs each choice instead."""
    from memfit.planner.composer import Composer
    from memfit.planner.runs import Runs

    model = dict(VIT)
    cfg = _cfg(model)
    meta = build_meta_model(model)
    facts = ModelFacts.of(meta)
    ref = Plan(micro_batch=2)
    with Runs(cfg, facts, meta, 1, False) as runs:
        assert Composer(runs, ref, gpu("4090"), 1, []).recorded
        meta.backbone.set_grad_checkpointing(True)
        assert not Composer(runs, ref, gpu("4090"), 1, []).recorded


def test_a_run_of_frees_is_recorded_in_the_order_its_storages_were_made():
    """Storages freed with nothing between them (a structure torn down, a garbage collection) go in an order that
    follows memory addresses, different from run to run: the recording keeps them in the order they were made, so
    that composed rows (and their simulated allocators) are the same every run."""
    from memfit.planner.timeline import ALLOC, FREE, Recorder

    rec = Recorder({})
    for key in (10, 11, 12, 13):
        rec.alloc(key, 512, False)
    rec.free(13)
    rec.alloc(14, 512, False)
    for key in (12, 14, 10):  # after an allocation: sorted among themselves only
        rec.free(key)
    assert rec.events[4:] == [(FREE, 4), (ALLOC, 5, 512, False), (FREE, 1), (FREE, 3), (FREE, 5)]
