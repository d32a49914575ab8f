"""GradientLARS's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' GradientLARS and
for a naive per-parameter loop (the usual hand-written hook), measured in one run.

    python benchmarks/lars.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from _timing import print_ratios, time_side_by_side
from normhooks import GradientLARS

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}
WEIGHT_DECAY = 1e-4


def naive_lars_(params: list[torch.Tensor], weight_decay: float) -> None:
    """The per-parameter loop most hand-written LARS hooks use: several kernels per tensor."""
    for param in params:
        grad = param.grad
        w_norm = torch.linalg.vector_norm(param)
        g_norm = torch.linalg.vector_norm(grad)
        rate = torch.where(w_norm > 1e-2, w_norm / (1e-9 + g_norm + weight_decay * w_norm), 1.0)
        grad.add_(param, alpha=weight_decay).mul_(rate)


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
        f"GradientLARS + SGD(momentum, foreach) vs SGD alone on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    for title, file in SETS.items():
        shapes = json.loads((args.shapes / file).read_text())
        plain = optimizer_for(shapes, device)
        hooked = optimizer_for(shapes, device)
        GradientLARS().attach(hooked)
        hooked_wd = optimizer_for(shapes, device)
        GradientLARS(weight_decay=WEIGHT_DECAY).attach(hooked_wd)
        naive = optimizer_for(shapes, device)
        naive_params = naive.param_groups[0]["params"]

        def naive_step(optimizer: torch.optim.SGD = naive, params: list = naive_params) -> None:
            with torch.no_grad():
                naive_lars_(params, WEIGHT_DECAY)
            optimizer.step()

        times = time_side_by_side(
            {
                "SGD alone": plain.step,
                "GradientLARS + SGD": hooked.step,
                f"GradientLARS(wd={WEIGHT_DECAY}) + SGD": hooked_wd.step,
                f"naive loop(wd={WEIGHT_DECAY}) + SGD": naive_step,
            },
            device,
            args.repeats,
        )
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{title}: {len(shapes)} tensors, {count:,} values", times, "SGD alone")
        del plain, hooked, hooked_wd, naive, naive_params


if __name__ == "__main__":
    main()
