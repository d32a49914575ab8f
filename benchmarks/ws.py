"""Weight standardization's cost on a ResNet-18 with GroupNorm, side by side.

Train step (forward + backward + SGD) and eval forward (eval mode, no_grad), batch 32 at
64x64, for: the plain model and a second copy of it (the run's noise); normhooks'
apply_weight_standardization; a reference that standardizes the way timm's StdConv2d does
(one F.batch_norm call on the reshaped weight, written here); and two floors on the same
layers: a parametrization that returns the weight unchanged (what torch's parametrize costs)
and one that multiplies it by 1 (one pass over the weights forward and one backward, less
than any standardization can move). Prints each as a ratio to the plain model.

    python benchmarks/ws.py [--device cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _models import ResNet18, with_empty_parametrizations
from _timing import compare_models
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
        "plain, a second copy (noise)": copy.deepcopy(plain),
        "normhooks WS": apply_weight_standardization(copy.deepcopy(plain)),
        "batch_norm-trick WS": ResNet18(conv=BatchNormStdConv2d).to(device),
        "empty parametrization (floor)": with_empty_parametrizations(copy.deepcopy(plain)),
        "x1.0 parametrization (floor)": with_empty_parametrizations(
            copy.deepcopy(plain), times_one=True
        ),
    }
    x = torch.randn(args.batch, 3, 64, 64, device=device)
    target = torch.randint(0, 100, (args.batch,), device=device)
    print(
        f"Weight standardization, batch {args.batch}, {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    compare_models("ResNet-18 (GroupNorm), 64x64", models, x, target, device, args.repeats)


if __name__ == "__main__":
    main()
