"""AdaptiveGradientClipping's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' AGC, for the
per-parameter loop AGC is usually written as (timm's ``adaptive_clip_grad`` has that shape;
the loop here is written from the paper's formula) and for GradientLARS, whose passes over
the data are the same (two norms and a multiply), measured in one run.

    python benchmarks/agc.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from _timing import print_ratios, time_side_by_side
from normhooks import AdaptiveGradientClipping, GradientLARS

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}
CLIPPING = 0.01
EPS = 1e-3


def per_parameter_agc_(params: list[torch.Tensor], clipping: float, eps: float) -> None:
    """One parameter at a time: unit norms, threshold, clipped copy, select, write back."""
    for param in params:
        grad = param.grad
        dims = tuple(range(1, param.ndim)) if param.ndim > 1 else None
        max_norm = torch.linalg.vector_norm(param, dim=dims, keepdim=True).clamp_(min=eps)
        max_norm.mul_(clipping)
        g_norm = torch.linalg.vector_norm(grad, dim=dims, keepdim=True)
        clipped = grad * (max_norm / g_norm.clamp(min=1e-6))
        grad.copy_(torch.where(g_norm < max_norm, grad, clipped))


def optimizer_for(shapes: list[list[int]], device: torch.device) -> torch.optim.SGD:
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device))
        # Small enough that about half the units are clipped: both branches do real work.
        param.grad = torch.randn(shape, device=device) * 0.01
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
        f"AdaptiveGradientClipping + SGD(momentum, foreach) vs SGD alone on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    for title, file in SETS.items():
        shapes = json.loads((args.shapes / file).read_text())
        plain = optimizer_for(shapes, device)
        plain_again = optimizer_for(shapes, device)
        hooked = optimizer_for(shapes, device)
        AdaptiveGradientClipping(CLIPPING, EPS).attach(hooked)
        lars = optimizer_for(shapes, device)
        GradientLARS().attach(lars)
        loop = optimizer_for(shapes, device)
        loop_params = loop.param_groups[0]["params"]

        def loop_step(optimizer: torch.optim.SGD = loop, params: list = loop_params) -> None:
            with torch.no_grad():
                per_parameter_agc_(params, CLIPPING, EPS)
            optimizer.step()

        times = time_side_by_side(
            {
                "SGD alone": plain.step,
                "SGD alone, again (noise)": plain_again.step,
                "AdaptiveGradientClipping + SGD": hooked.step,
                "per-parameter loop + SGD": loop_step,
                "GradientLARS + SGD (the peer hook)": lars.step,
            },
            device,
            args.repeats,
        )
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{title}: {len(shapes)} tensors, {count:,} values", times, "SGD alone")
        del plain, plain_again, hooked, lars, loop, loop_params


if __name__ == "__main__":
    main()
