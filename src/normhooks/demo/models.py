"""The demo's network: a three-convolution CNN with a choice of normalization layer.

Sized for 8x8 digits (about 55,000 parameters) and any image size: two stride-2
convolutions and a global average pool, so it runs in milliseconds per step on a CPU.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

__all__ = ["GROUPS", "WIDTHS", "GlobalAveragePool", "Norm", "small_cnn"]

Norm = Literal["batch", "group", "none"]

WIDTHS = (32, 64, 64)
# GroupNorm's groups: Qiao et al. use 32 groups on 64+ channels; 8 keeps at least 4 channels
# per group on this network's 32-channel layer.
GROUPS = 8


def _norm_layer(norm: Norm, channels: int) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        return nn.GroupNorm(min(GROUPS, channels), channels)
    return nn.Identity()


def small_cnn(in_channels: int, num_classes: int, norm: Norm) -> nn.Sequential:
    """``[conv3x3 -> norm -> ReLU] x 3`` (strides 1, 2, 2), global average pool, linear.

    Convolutions followed by a normalization layer have no bias (the layer's shift replaces
    it); with ``norm="none"`` they do.

    Args:
        in_channels: channels of the input images.
        num_classes: outputs of the final linear layer.
        norm: ``"batch"`` (BatchNorm2d), ``"group"`` (GroupNorm) or ``"none"``.

    Example:
        >>> import torch
        >>> model = small_cnn(1, 10, "group")
        >>> model(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    if norm not in ("batch", "group", "none"):
        raise ValueError(f"norm must be 'batch', 'group' or 'none', got norm={norm!r}")
    layers: list[nn.Module] = []
    channels = in_channels
    for width, stride in zip(WIDTHS, (1, 2, 2), strict=True):
        layers += [
            nn.Conv2d(channels, width, 3, stride=stride, padding=1, bias=norm == "none"),
            _norm_layer(norm, width),
            nn.ReLU(),
        ]
        channels = width
    layers += [GlobalAveragePool(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class GlobalAveragePool(nn.Module):
    """``[N, C, H, W] -> [N, C]``, the mean over each channel's positions.

    A plain mean rather than ``nn.AdaptiveAvgPool2d``, whose CUDA backward has no
    deterministic implementation (it would fail under ``torch.use_deterministic_algorithms``).
    """

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=(2, 3))
