"""Weight standardization's cost on a ResNet-18 with GroupNorm, side by side.

Train step (forward + backward + SGD) and eval forward (eval mode, no_grad), batch 32 at
64x64, for: the plain model; normhooks' apply_weight_standardization; and a reference that
standardizes the way timm's StdConv2d does (one F.batch_norm call on the reshaped weight,
written here). Prints each as a ratio to the plain model.

    python benchmarks/ws.py [--device cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _models import ResNet18
from _timing import print_ratios, time_side_by_side
from normhooks import apply_weight_standardization


class BatchNormStdConv2d(nn.Conv2d):
    """Conv2d that standardizes its weight with one F.batch_norm call (the timm approach)."""

    def forward(self, x: Tensor) -> Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            training=True,
            momentum=0.0,
            eps=1e-5,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain = ResNet18().to(device)
    models = {
        "plain": plain,
        "normhooks WS": apply_weight_standardization(copy.deepcopy(plain)),
        "batch_norm-trick WS": ResNet18(conv=BatchNormStdConv2d).to(device),
    }
    x = torch.randn(args.batch, 3, 64, 64, device=device)
    target = torch.randint(0, 100, (args.batch,), device=device)

    def train_step(model: nn.Module) -> None:
        optimizer = optimizers[model]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), target).backward()
        optimizer.step()

    def eval_forward(model: nn.Module) -> None:
        with torch.no_grad():
            model(x)

    optimizers = {
        m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in models.values()
    }
    print(
        f"Weight standardization on ResNet-18 (GroupNorm), batch {args.batch} at 64x64, {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    for model in models.values():
        model.train()
    train = time_side_by_side(
        {name: (lambda m=m: train_step(m)) for name, m in models.items()}, device, args.repeats
    )
    print_ratios("train step (forward + backward + SGD)", train, "plain")
    for model in models.values():
        model.eval()
    evaluation = time_side_by_side(
        {name: (lambda m=m: eval_forward(m)) for name, m in models.items()},
        device,
        args.repeats * 3,
    )
    print_ratios("eval forward (no_grad)", evaluation, "plain")


if __name__ == "__main__":
    main()
