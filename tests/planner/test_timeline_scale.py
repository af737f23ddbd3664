"""A recorded forward/backward scaled to another micro-batch (memfit/planner/timeline_scale.py) composes as the
recording at that micro-batch does: tracked peaks, the simulated CUDA allocator's peaks (two training steps,
with and without accumulation), FLOPs and bytes written; a reduction's kernel scratch is worked out again."""

from __future__ import annotations

import pytest

from memfit.measure import CachingAllocatorModel
from memfit.planner.fake import build_meta_model, fake_process_group, first_batch, measure_step
from memfit.planner.kernel_scratch import Blocks, NormBlocks
from memfit.planner.recompute import compose
from memfit.planner.space import ModelFacts, Plan, checkpointed_modules
from memfit.planner.timeline import ALLOC, OP, SCRATCH, Timeline
from memfit.planner.timeline_scale import at_micro_batch, scaled_recording

MiB = 2**20
SLACK = 1024  # bytes: autocast's casts may free a few hundred bytes in another order
VIT = dict(type="TimmClassifier", model_name="vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=8,
           embed_dim=64, depth=3, num_heads=2, drop_path_rate=0.0)
SWIN = dict(type="TimmClassifier", model_name="swin_tiny_patch4_window7_224", num_classes=4, img_size=64,
            embed_dim=32, depths=(2, 2), num_heads=(2, 4), drop_path_rate=0.0)
EPILOGUE = [(0, 3 * MiB), (1, 5 * MiB), (1, None)]  # an optimizer step's state and one temporary


def _recordings(model: dict, image: int, precision: str, batches: tuple[int, ...]):
    wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.01))
    if precision == "bf16":
        wrapper.update(type="AmpOptimWrapper", dtype="bfloat16")
    meta = build_meta_model(model)
    facts = ModelFacts.of(meta)
    names = {c: checkpointed_modules(meta, facts, c) for c in ("blocks", "selective")}
    record = tuple(sorted({*facts.blocks, *(n for ns in names.values() for n in ns)}))
    out = {}
    with fake_process_group(1):
        for mb in batches:
            data = dict(type="ShapesDataset", image_size=image, num_classes=4, num_samples=16)
            cfg = dict(model=model, optim_wrapper=wrapper, train_dataloader=dict(
                batch_size=mb, num_workers=0, dataset=data, sampler=dict(type="DefaultSampler")))
            c = Plan(precision, "none", micro_batch=mb).apply(cfg, facts)
            c["strategy"] = dict(type="SingleDeviceStrategy")
            out[mb] = measure_step(c, full=False, batch=first_batch(c["train_dataloader"]), meta_model=meta,
                                   cuda=True, record=record)
    return out, names


@pytest.mark.parametrize(("model", "image", "precision"), [(VIT, 32, "fp32"), (VIT, 32, "bf16"),
                                                           (SWIN, 64, "fp32")])
def test_a_scaled_recording_composes_as_the_recording_at_its_micro_batch(model, image, precision):
    runs, names = _recordings(model, image, precision, (2, 6, 8, 16))
    for mb in (2, 6):  # below both recordings, and between them
        scaled = scaled_recording(runs[8], runs[16], (8, 16), mb)
        assert scaled is not None, mb
        recorded = runs[mb]
        assert (scaled.flops, scaled.conv_flops, scaled.written) == \
            (recorded.flops, recorded.conv_flops, recorded.written)
        for choice in ("none", "blocks", "selective"):
            for micro_steps in (1, 2):
                got, want = (compose(r.timeline, names.get(choice, ()), selective=choice == "selective",
                                     epilogue=EPILOGUE, micro_steps=micro_steps) for r in (scaled, recorded))
                what = f"mb {mb} {choice} x{micro_steps}: scaled {got}, recorded {want}"
                assert abs(got.peak - want.peak) <= SLACK, what
                assert abs(got.peak_without_grads - want.peak_without_grads) <= SLACK, what
                assert abs(got.cuda_allocated - want.cuda_allocated) <= SLACK, what
                assert got.cuda_reserved == want.cuda_reserved, what
                assert (got.flops, got.written) == (want.flops, want.written), what


def test_a_reductions_scratch_is_worked_out_again_at_the_new_micro_batch():
    """A bias gradient over batch x tokens rows: its split (and staging buffer) is not linear in the batch; its
    input's shape and strides are."""
    def event(b: int) -> tuple:
        blocks = Blocks.of((b * 197, 3072), (3072, 1), 0, 2, (0,), 4, (132, 2048))
        return (ALLOC, 1, b * 197 * 3072 * 2, False), (9, tuple(blocks), blocks.spec)

    def timeline(b: int) -> Timeline:
        return Timeline(events=[*event(b), (OP, b * 10, b * 4, False)])

    for b in (1, 4, 12):
        scaled = at_micro_batch(timeline(16), timeline(32), (16, 32), b)
        assert scaled.events == [event(b)[0], (9, event(b)[1][1], None), (OP, b * 10, b * 4, False)], b
    # None at 4 images, split at 12, and not in proportion between the recordings
    assert not event(4)[1][1] and event(12)[1][1] and event(32)[1][1][0] != 2 * event(16)[1][1][0]


def test_a_layer_norms_scratch_is_worked_out_again_across_its_two_pass_threshold():
    """A Swin-L first stage's layer norm backward (3,136 rows of 192 features an image) with a copy of a transposed
    gradient: one pass at 16 images, two past 65,536 rows (21 images), its partial sums capped from 56 images.
    Recorded at 16 and 32 images (one block, then five), each micro-batch's blocks are its own."""
    def event(b: int) -> tuple:
        blocks = NormBlocks.of((b * 3136 * 192 * 4,), b * 3136, 192, 4, 2, (132, 2048))
        return (ALLOC, 1, b * 3136 * 192 * 4, False), (SCRATCH, tuple(blocks), blocks.spec)

    def timeline(b: int) -> Timeline:
        return Timeline(events=[*event(b), (OP, b * 10, b * 4, False)])

    assert len(event(16)[1][1]) == 1 and len(event(24)[1][1]) == 5 and event(56)[1][1][1] == event(64)[1][1][1]
    for b in (8, 24, 40, 64):
        scaled = at_micro_batch(timeline(16), timeline(32), (16, 32), b)
        assert scaled.events[1] == (SCRATCH, event(b)[1][1], None), b


def test_a_rolls_copy_of_its_input_scales_with_the_batch():
    """Scratch without a reduction's arguments (a multi-dim ``torch.roll``'s copy of its input) is on the line
    through its sizes at the two recordings."""
    def timeline(b: int) -> Timeline:
        return Timeline(events=[(ALLOC, 1, b * 4096, False), (SCRATCH, (b * 4096,), None), (OP, 0, b * 4096, False)])

    assert at_micro_batch(timeline(16), timeline(32), (16, 32), 4).events[1] == (SCRATCH, (4 * 4096,), None)
    odd = Timeline(events=[(ALLOC, 1, 32 * 4096, False), (SCRATCH, (1, 2), None), (OP, 0, 32 * 4096, False)])
    assert at_micro_batch(timeline(16), odd, (16, 32), 4) is None  # another number of blocks


def test_recordings_with_other_events_are_not_scaled():
    a = Timeline(events=[(ALLOC, 1, 100, False), (OP, 10, 4, False)])
    b = Timeline(events=[(OP, 20, 8, False), (ALLOC, 1, 200, False)])
    assert at_micro_batch(a, b, (1, 2), 4) is None
    shrinking = Timeline(events=[(ALLOC, 1, 50, False), (OP, 10, 4, False)])  # smaller at the larger batch
    assert at_micro_batch(a, shrinking, (1, 2), 8) is None


def test_a_later_micro_step_adds_its_gradients_in_place():
    """Accumulating, the second forward/backward's gradients are temporaries beside the first's, which stay:
    the allocator holds both for a moment and reserves a segment for it."""
    def run(micro_steps: int) -> CachingAllocatorModel:
        model = CachingAllocatorModel()
        model.malloc("params", 30 * MiB)
        start = len(model.trace)
        model.malloc("act", 30 * MiB)
        model.malloc("grad", 30 * MiB)
        model.free("act")
        model.finish_steps(start, [], model.held_since(start), micro_steps)
        return model

    once, twice = run(1), run(2)
    assert once.allocated == twice.allocated == 30 * MiB  # the parameters; zero_grad freed the gradients
    assert once.peak_allocated == 90 * MiB
    # The second micro-step's activation takes the first's block; its gradient needs a third beside the kept one.
    assert twice.peak_allocated == 120 * MiB
    assert twice.peak_reserved == once.peak_reserved + 30 * MiB
