"""Weight normalization's cost on a ResNet-18 and a 2-layer LSTM, side by side.

Train step (forward + backward + SGD) and eval forward (eval mode, no_grad), for: the plain
model; normhooks' weight_norm; and torch's torch.nn.utils.parametrizations.weight_norm on the
same weights. Prints each as a ratio to the plain model.

    python benchmarks/wn.py [--device cuda] [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

from _models import ResNet18
from _timing import print_ratios, time_side_by_side
from normhooks import weight_norm


class LSTMModel(nn.Module):
    def __init__(self, features: int = 128, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def with_torch_weight_norm(model: nn.Module) -> nn.Module:
    """torch's weight_norm on every parameter that normhooks converts (2 or more dims)."""
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim >= 2:
                torch_weight_norm(module, name)
    return model


def compare(
    title: str, plain: nn.Module, x: Tensor, target: Tensor, device: torch.device, repeats: int
) -> None:
    models = {
        "plain": plain,
        "normhooks weight_norm": weight_norm(copy.deepcopy(plain)),
        "torch weight_norm": with_torch_weight_norm(copy.deepcopy(plain)),
    }
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()
    }

    def train_step(name: str) -> Callable[[], None]:
        def run() -> None:
            optimizers[name].zero_grad(set_to_none=True)
            F.cross_entropy(models[name](x), target).backward()
            optimizers[name].step()

        return run

    def eval_forward(name: str) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                models[name](x)

        return run

    for model in models.values():
        model.train()
    train = time_side_by_side({n: train_step(n) for n in models}, device, repeats)
    print_ratios(f"{title}: train step (forward + backward + SGD)", train, "plain")
    for model in models.values():
        model.eval()
    evaluation = time_side_by_side({n: eval_forward(n) for n in models}, device, repeats * 3)
    print_ratios(f"{title}: eval forward (no_grad)", evaluation, "plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(
        f"Weight normalization, batch {args.batch}, {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    compare(
        "ResNet-18 (GroupNorm), 64x64",
        ResNet18().to(device),
        torch.randn(args.batch, 3, 64, 64, device=device),
        torch.randint(0, 100, (args.batch,), device=device),
        device,
        args.repeats,
    )
    compare(
        "2-layer LSTM (128 -> 256), 32 steps",
        LSTMModel().to(device),
        torch.randn(args.batch, 32, 128, device=device),
        torch.randint(0, 10, (args.batch,), device=device),
        device,
        args.repeats,
    )


if __name__ == "__main__":
    main()
