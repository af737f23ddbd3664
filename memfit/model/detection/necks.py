"""ChannelMapper (MMDetection's neck for DETR-style detectors): maps each backbone level to the same width."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from memfit.errors import ConfigError
from memfit.registry import MODELS


def _conv_module(in_ch: int, out_ch: int, kernel_size: int, stride: int, norm_cfg: dict | None,
                 act_cfg: dict | None) -> nn.Sequential:
    """MMCV's ``ConvModule`` (conv -> norm -> act) with its child names ``conv``/``gn``/``bn``."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["conv"] = nn.Conv2d(in_ch, out_ch, kernel_size, stride, (kernel_size - 1) // 2, bias=norm_cfg is None)
    nn.init.xavier_uniform_(layers["conv"].weight)  # MMDetection's ChannelMapper init_cfg: Xavier on Conv2d
    if layers["conv"].bias is not None:
        nn.init.zeros_(layers["conv"].bias)
    if norm_cfg is not None:
        if norm_cfg.get("type") == "GN":
            layers["gn"] = nn.GroupNorm(norm_cfg.get("num_groups", 32), out_ch)
        else:
            layers["bn"] = nn.BatchNorm2d(out_ch)
    if act_cfg is not None:
        layers["activate"] = nn.ReLU(inplace=True)
    return nn.Sequential(layers)


@MODELS.register()
class ChannelMapper(nn.Module):
    """A ``kernel_size`` conv (+ norm, + activation) per input level to ``out_channels``; with ``num_outs``
    above the number of inputs, extra levels come from 3x3 stride-2 convs, the first on the last input
    map and each further one on the previous extra level. ``forward(list of NCHW maps)`` -> list."""

    def __init__(self, in_channels: list[int], out_channels: int, kernel_size: int = 3, conv_cfg: dict | None = None,
                 norm_cfg: dict | None = None, act_cfg: dict | None = dict(type="ReLU"),  # noqa: B006 - read only
                 num_outs: int | None = None, bias: str | bool = "auto") -> None:
        super().__init__()
        if conv_cfg is not None:
            raise ConfigError(f"model.neck.conv_cfg={conv_cfg!r} is not supported: use None (nn.Conv2d)")
        if norm_cfg is not None and norm_cfg.get("type") not in ("GN", "BN", "SyncBN"):
            raise ConfigError(f"model.neck.norm_cfg={norm_cfg!r}: use dict(type='GN', num_groups=32), BN or None")
        if norm_cfg is not None and set(norm_cfg) - {"type", "num_groups", "requires_grad"}:
            raise ConfigError(f"model.neck.norm_cfg={norm_cfg!r}: only type, num_groups and requires_grad are read")
        if act_cfg is not None and act_cfg.get("type") != "ReLU":
            raise ConfigError(f"model.neck.act_cfg={act_cfg!r} is not supported: use None or dict(type='ReLU')")
        if bias != "auto":
            raise ConfigError(f"model.neck.bias={bias!r} is not supported: use 'auto' (no bias before a norm)")
        in_channels = list(in_channels)
        self.num_outs = num_outs or len(in_channels)
        if self.num_outs < len(in_channels):
            raise ConfigError(f"model.neck.num_outs={num_outs} is below the {len(in_channels)} input levels")
        self.convs = nn.ModuleList(_conv_module(c, out_channels, kernel_size, 1, norm_cfg, act_cfg)
                                   for c in in_channels)
        extra = [in_channels[-1]] + [out_channels] * (self.num_outs - len(in_channels) - 1)
        self.extra_convs = nn.ModuleList(_conv_module(c, out_channels, 3, 2, norm_cfg, act_cfg)
                                         for c in extra[: self.num_outs - len(in_channels)])
        self.in_channels, self.out_channels = in_channels, out_channels

    def forward(self, inputs: list[Tensor]) -> list[Tensor]:
        if len(inputs) != len(self.convs):
            raise ValueError(f"ChannelMapper got {len(inputs)} maps, in_channels lists {len(self.convs)}")
        outs = [conv(x) for conv, x in zip(self.convs, inputs)]
        for i, conv in enumerate(self.extra_convs):
            outs.append(conv(inputs[-1] if i == 0 else outs[-1]))
        return outs
