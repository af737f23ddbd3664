"""Checks across the Runner's pieces, made before the first training step.

Each component checks its own arguments where they enter (a scheduler its ``step_size``, the optimizer
wrapper its ``loss_scale``, a strategy its backend config). What no component can see alone is checked
here: the val/test triples (MMEngine's Runner refuses a partial one at construction) and the
dataset's classes against the model's outputs (a label the model has no logit for fails at iteration 1,
deep inside the loss).
"""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError


def check_eval_configs(**triples: tuple[Any, Any, Any]) -> None:
    """``val=(val_dataloader, val_evaluator, val_cfg)``, ``test=(...)``: each all set or all None, as
    MMEngine's Runner asserts; one given without the others would leave that loop off without a word."""
    for mode, parts in triples.items():
        names = (f"{mode}_dataloader", f"{mode}_evaluator", f"{mode}_cfg")
        given = [n for n, v in zip(names, parts) if v is not None]
        if given and len(given) < len(names):
            missing = [n for n in names if n not in given]
            raise ConfigError(f"{' and '.join(given)} given without {' and '.join(missing)}: {mode}_dataloader, "
                              f"{mode}_evaluator and {mode}_cfg go together: add {', '.join(missing)} "
                              f"(e.g. {mode}_evaluator=dict(type='Accuracy'), {mode}_cfg=dict()) or remove "
                              f"{', '.join(given)}")


def dataset_classes(dataset: Any) -> tuple[int, str] | None:
    """How many classes ``dataset`` declares and where (``num_classes=4``, ``metainfo['classes']``), or None."""
    declared = getattr(dataset, "num_classes", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared, f"num_classes={declared}"
    classes = (getattr(dataset, "metainfo", None) or {}).get("classes")
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes), f"metainfo['classes'] names {len(classes)} classes"
    return None


def check_classes(model: Any, **loaders: Any) -> None:
    """A model that declares ``num_classes`` (memfit's classifiers and detectors) must have a logit for every class its
    datasets declare (``train_dataloader=loader, ...``). More outputs than classes is allowed."""
    outputs = getattr(model, "num_classes", None)
    if not isinstance(outputs, int) or isinstance(outputs, bool):
        return
    where = getattr(model, "num_classes_key", "model.num_classes")  # a detector's may be its head's
    for key, loader in loaders.items():
        found = dataset_classes(getattr(loader, "dataset", None))
        if found is not None and found[0] > outputs:
            raise ConfigError(f"{where}={outputs} but {key}.dataset.{found[1]}: labels "
                              f"{outputs}..{found[0] - 1} would have no output (an out-of-bounds target at the first "
                              f"step): set {where}={found[0]}")
