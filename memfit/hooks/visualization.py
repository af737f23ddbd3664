"""The visualization hooks of MMEngine's codebases, accepted where their configs name them.

MMDetection's ``default_runtime.py`` sets ``default_hooks.visualization=dict(type='DetVisualizationHook')``
(MMSegmentation's ``SegVisualizationHook``, MMPretrain's ``VisualizationHook`` alike). With their defaults
(``draw=False``, ``enable=False``) they draw nothing, and here they do nothing either; memfit draws no images,
so asking one to draw, show or write images logs one warning naming the hook (:func:`memfit.errors.warn_ignored`).
Their other arguments (``interval``, ``score_thr``, ...) only tune the drawing and are accepted as they are.
"""

from __future__ import annotations

from memfit.errors import warn_ignored
from memfit.hooks.base import Hook
from memfit.registry import HOOKS

_WHY = "memfit draws no images (validation metrics and scalars are logged as usual)"


class _DrawsNoImages(Hook):
    """Accepts the drawing hook's arguments; warns once when they ask for drawing."""

    priority = "NORMAL"

    def __init__(self, draw: bool = False, enable: bool = False, show: bool = False, test_out_dir: str | None = None,
                 out_dir: str | None = None, interval: int = 50, frame_interval: int = 30, score_thr: float = 0.3,
                 wait_time: float = 0.0, backend_args: dict | None = None,
                 file_client_args: dict | None = None) -> None:
        asked = {"draw": draw, "enable": enable, "show": show, "test_out_dir": test_out_dir, "out_dir": out_dir}
        for name, value in asked.items():
            if value:
                warn_ignored(f"{type(self).__name__}({name}={value!r})", _WHY)


@HOOKS.register()
class DetVisualizationHook(_DrawsNoImages):
    """MMDetection's (``draw=False`` by default)."""


@HOOKS.register()
class TrackVisualizationHook(_DrawsNoImages):
    """MMDetection's tracking one (``draw=False`` by default)."""


@HOOKS.register()
class SegVisualizationHook(_DrawsNoImages):
    """MMSegmentation's (``draw=False`` by default)."""


@HOOKS.register()
class VisualizationHook(_DrawsNoImages):
    """MMPretrain's (``enable=False`` by default)."""


@HOOKS.register()
class NaiveVisualizationHook(Hook):
    """MMEngine's, which draws every test image: it has no effect here, and says so once."""

    priority = "NORMAL"

    def __init__(self, interval: int = 1, draw_gt: bool = True, draw_pred: bool = True) -> None:
        warn_ignored("NaiveVisualizationHook", _WHY)
