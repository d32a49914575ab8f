"""Weight normalization's cost on a ResNet-18 and a 2-layer LSTM, side by side.

Train step (forward + backward + SGD) and eval forward (eval mode, no_grad), for: the plain
model and a second copy of it (the run's noise); normhooks' weight_norm; torch's
torch.nn.utils.parametrizations.weight_norm on the same weights; and, as the floor any
parametrization starts from, a parametrization that returns its input unchanged on the same
weights. Prints each as a ratio to the plain model.

    python benchmarks/wn.py [--device cuda] [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

from _models import LSTMModel, ResNet18, on_every_matrix, with_empty_parametrizations
from _timing import compare_models
from normhooks import weight_norm


def compare(
    title: str, plain: nn.Module, x: Tensor, target: Tensor, device: torch.device, repeats: int
) -> None:
    models = {
        "plain": plain,
        "plain, a second copy (noise)": copy.deepcopy(plain),
        "normhooks weight_norm": on_every_matrix(weight_norm, copy.deepcopy(plain)),
        "torch weight_norm": on_every_matrix(torch_weight_norm, copy.deepcopy(plain)),
        "empty parametrization (floor)": with_empty_parametrizations(copy.deepcopy(plain)),
    }
    compare_models(title, models, x, target, device, repeats)


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
