"""Models the benchmarks share, written in the project."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.nn.utils import parametrize


class BasicBlock(nn.Module):
    def __init__(self, conv: type[nn.Conv2d], cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(32, cout)
        self.conv2 = conv(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(32, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                conv(cin, cout, 1, stride, bias=False), nn.GroupNorm(32, cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with GroupNorm (32 groups), the setting weight standardization targets."""

    def __init__(self, conv: type[nn.Conv2d] = nn.Conv2d, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            conv(3, 64, 7, 2, 3, bias=False),
            nn.GroupNorm(32, 64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks = []
        cin = 64
        for cout, stride in [
            (64, 1),
            (64, 1),
            (128, 2),
            (128, 1),
            (256, 2),
            (256, 1),
            (512, 2),
            (512, 1),
        ]:
            blocks.append(BasicBlock(conv, cin, cout, stride))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))

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
