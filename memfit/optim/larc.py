"""LARC: LARS with the trust ratio clipped, as NVIDIA Apex's LARC that VISSL's ``use_larc`` wraps.

timm 1.0 ships ``timm.optim.Lars`` (registered lazily as ``'Lars'``) whose ``trust_clip=True`` is
LARC's clipping mode; it has no ``Larc`` class, so this module adds one. Only the defaults differ:
``trust_clip=True`` and ``always_adapt=True`` (Apex adapts every parameter; timm's Lars adapts only
groups with weight decay, so norms and biases with ``norm_decay_mult=0`` would escape the trust
ratio). VISSL's ``larc_config`` names are accepted too: ``clip`` for ``trust_clip`` and
``trust_coefficient`` for ``trust_coeff``.

Per parameter, with ``ratio = trust_coeff * |w| / (|g| + weight_decay * |w| + eps)`` (1 when
either norm is 0) and, when clipping, ``ratio = min(ratio / lr, 1)``, the step is SGD on the
gradient ``(g + weight_decay * w) * ratio``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from timm.optim import Lars

from memfit.errors import ConfigError
from memfit.registry import OPTIMIZERS

_LARS_ARGS = inspect.signature(Lars).parameters


@OPTIMIZERS.register()
class Larc(Lars):
    """timm's Lars with LARC defaults (clipped trust ratio, every parameter adapted); see module doc."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1.0,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        trust_coeff: float | None = None,
        eps: float = 1e-8,
        trust_clip: bool | None = None,
        always_adapt: bool = True,
        foreach: bool | None = None,
        *,
        clip: bool | None = None,
        trust_coefficient: float | None = None,
    ) -> None:
        # The VISSL spelling and the timm spelling of one option may not both be given.
        for ours, theirs, a, b in (("trust_clip", "clip", trust_clip, clip),
                                   ("trust_coeff", "trust_coefficient", trust_coeff, trust_coefficient)):
            if a is not None and b is not None:
                raise ConfigError(f"optimizer: give {ours!r} or its VISSL alias {theirs!r}, not both")
        clip = trust_clip if clip is None else clip
        trust_clip = True if clip is None else bool(clip)
        trust_coeff = trust_coeff if trust_coeff is not None else trust_coefficient
        # ``foreach`` is newer than some timm releases' Lars: passed only when given and accepted.
        extra = {"foreach": foreach} if foreach is not None and "foreach" in _LARS_ARGS else {}
        super().__init__(
            params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, trust_coeff=0.001 if trust_coeff is None else trust_coeff, eps=eps,
            trust_clip=trust_clip, always_adapt=always_adapt, **extra,
        )
