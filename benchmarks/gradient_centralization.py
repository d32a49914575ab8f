"""GradientCentralization's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' gradient
centralization and for pytorch-optimizer's ``centralize_gradient`` called on each parameter's
gradient before the step (the per-parameter loop its optimizers run), measured in one run.

    python benchmarks/gradient_centralization.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import torch
from pytorch_optimizer.optimizer.gradient_centralization import centralize_gradient

from _hooks import Step, after, hooked, optimizer_for, run
from normhooks import GradientCentralization


def their_loop_(params: list[torch.Tensor]) -> None:
    for param in params:
        centralize_gradient(param.grad)


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    return {
        "SGD alone": optimizer_for(shapes, device).step,
        "SGD alone, again (noise)": optimizer_for(shapes, device).step,
        "GradientCentralization + SGD": hooked(
            optimizer_for(shapes, device), GradientCentralization()
        ),
        "pytorch-optimizer centralize_gradient + SGD": after(
            their_loop_, optimizer_for(shapes, device)
        ),
    }


if __name__ == "__main__":
    run(__doc__, "SGD alone", candidates)
