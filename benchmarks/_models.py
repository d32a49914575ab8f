"""Models the benchmarks share, written in the project."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize


def _group_norm(channels: int) -> nn.GroupNorm:
    # 32 groups, as the paper's ResNets have; narrower layers get one channel per group.
    return nn.GroupNorm(min(32, channels), channels)


class BasicBlock(nn.Module):
    def __init__(self, conv: type[nn.Conv2d], cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _group_norm(cout)
        self.conv2 = conv(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _group_norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(conv(cin, cout, 1, stride, bias=False), _group_norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with GroupNorm (32 groups), the setting weight standardization targets.

    ``width`` is the first stage's channels (64 in the paper; the later stages double it):
    the host-time proxy narrows it so that the layers' compute vanishes beside their dispatch.
    """

    def __init__(
        self, conv: type[nn.Conv2d] = nn.Conv2d, classes: int = 100, width: int = 64
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            conv(3, width, 7, 2, 3, bias=False),
            _group_norm(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks = []
        cin = width
        for factor, stride in [(1, 1), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 2), (8, 1)]:
            blocks.append(BasicBlock(conv, cin, width * factor, stride))
            cin = width * factor
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))


class LSTMModel(nn.Module):
    """A 2-layer LSTM classifier: RNNs read each parametrized weight several times a forward."""

    def __init__(self, features: int = 128, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def on_every_matrix(convert: Callable[[nn.Module, str], object], model: nn.Module) -> nn.Module:
    """``convert(module, name)`` on every parameter with 2 or more dims (the LSTM's too)."""
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim >= 2:
                convert(module, name)
    return model


def on_every_conv(convert: Callable[[nn.Module], object], model: nn.Module) -> nn.Module:
    """``convert(module)`` on every convolution, one layer at a time."""
    for module in list(model.modules()):
        if isinstance(module, nn.Conv2d):
            convert(module)
    return model


class _Unchanged(nn.Module):
    """A parametrization that returns its input: what torch's parametrize costs by itself."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight


class _TimesOne(nn.Module):
    """A parametrization that multiplies by 1: one pass over the weight forward and one
    backward, less than any reparametrization that computes a new weight can move."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight * 1.0


def with_empty_parametrizations(
    model: nn.Module, min_ndim: int = 2, *, times_one: bool = False
) -> nn.Module:
    """Registers a do-nothing parametrization (or, with ``times_one``, a multiply by 1) on
    every parameter with ``min_ndim`` or more dimensions: the floors that any
    parametrization-based reparametrization starts from."""
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim >= min_ndim:
                floor = _TimesOne() if times_one else _Unchanged()
                parametrize.register_parametrization(module, name, floor)
    return model


class BatchNormStandardization(nn.Module):
    """Weight standardization as timm's StdConv2d computes it, as a parametrization:
    ``F.batch_norm`` over the weight viewed as ``[1, out, -1]``, training mode, momentum 0, no
    running statistics. Written here from that description."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, weight: Tensor) -> Tensor:
        rows = weight.reshape(1, weight.shape[0], -1)
        standardized = F.batch_norm(rows, None, None, training=True, momentum=0.0, eps=self.eps)
        return standardized.reshape_as(weight)


def with_batch_norm_standardization(model: nn.Module, eps: float = 1e-5) -> nn.Module:
    """:class:`BatchNormStandardization` on every Conv2d's weight."""
    for module in list(model.modules()):
        if isinstance(module, nn.Conv2d):
            parametrize.register_parametrization(module, "weight", BatchNormStandardization(eps))
    return model


def parametrized_tensors(model: nn.Module) -> int:
    """How many tensors of ``model`` are parametrized: the layers a reparametrization costs."""
    return sum(
        len(module.parametrizations)
        for module in model.modules()
        if parametrize.is_parametrized(module)
    )
