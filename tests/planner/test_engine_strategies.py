"""A strategy whose engine cannot run on fake tensors (DeepSpeed's, colossalai's, or one registered by a
user that says so in its Capabilities) is planned as the FSDP2 / ZeRO-1 step of the sharding it declares,
with a note; ``--as-is`` included."""

from __future__ import annotations

import pytest

from memfit.planner.devices import gpu
from memfit.planner.predict import predict

MODEL = dict(type="TimmClassifier", model_name="vit_tiny_patch16_224", num_classes=4, img_size=32, patch_size=4,
             embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.0)
LOADER = dict(batch_size=2, num_workers=0, dataset=dict(type="ShapesDataset", image_size=32, num_classes=4,
                                                        num_samples=8))


def _cfg(strategy: dict) -> dict:
    return dict(model=MODEL, train_dataloader=LOADER, strategy=strategy,
                optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-3)))


@pytest.mark.parametrize("engine, stand_in", [
    (dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=3)), dict(type="FSDPStrategy")),
    (dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=2)),
     dict(type="FSDPStrategy", reshard_after_forward=False)),
    (dict(type="DeepSpeedStrategy", zero_optimization=dict(stage=1)), dict(type="DDPStrategy", zero=True)),
])
def test_an_engine_strategy_is_planned_as_the_step_of_its_sharding(engine, stand_in):
    h100 = gpu("H100")
    own = predict(_cfg(engine), device=h100, world_size=2, as_is=True)
    same = predict(_cfg(stand_in), device=h100, world_size=2, as_is=True)
    r, s = own.results[0], same.results[0]
    assert (r.plan.sharding, r.allocated, r.reserved, r.peak_bytes) == \
        (s.plan.sharding, s.allocated, s.reserved, s.peak_bytes)
    assert any("DeepSpeedStrategy runs its own engine" in n and f"({r.plan.sharding})" in n for n in own.notes)
    assert not any("own engine" in n for n in same.notes)
