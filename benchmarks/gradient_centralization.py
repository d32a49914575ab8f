"""GradientCentralization's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' gradient
centralization and for pytorch-optimizer's ``centralize_gradient`` called on each parameter's
gradient before the step (the per-parameter loop its optimizers run), measured in one run.

    python benchmarks/gradient_centralization.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from pytorch_optimizer.optimizer.gradient_centralization import centralize_gradient

from _timing import print_ratios, time_side_by_side
from normhooks import GradientCentralization

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}


def optimizer_for(shapes: list[list[int]], device: torch.device) -> torch.optim.SGD:
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device))
        param.grad = torch.randn(shape, device=device)
        params.append(param)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    optimizer.step()  # creates the momentum buffers outside the timed region
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", type=Path, default=SHAPES, help="folder of shape files")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"GradientCentralization + SGD(momentum, foreach) vs SGD alone on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    for title, file in SETS.items():
        shapes = json.loads((args.shapes / file).read_text())
        plain = optimizer_for(shapes, device)
        plain_again = optimizer_for(shapes, device)
        hooked = optimizer_for(shapes, device)
        GradientCentralization().attach(hooked)
        theirs = optimizer_for(shapes, device)
        their_params = theirs.param_groups[0]["params"]

        def their_step(optimizer: torch.optim.SGD = theirs, params: list = their_params) -> None:
            with torch.no_grad():
                for param in params:
                    centralize_gradient(param.grad)
            optimizer.step()

        times = time_side_by_side(
            {
                "SGD alone": plain.step,
                "SGD alone, again (noise)": plain_again.step,
                "GradientCentralization + SGD": hooked.step,
                "pytorch-optimizer centralize_gradient + SGD": their_step,
            },
            device,
            args.repeats,
        )
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{title}: {len(shapes)} tensors, {count:,} values", times, "SGD alone")
        del plain, plain_again, hooked, theirs, their_params


if __name__ == "__main__":
    main()
