"""GradientLARS's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' GradientLARS and
for a naive per-parameter loop (the usual hand-written hook), measured in one run.

    python benchmarks/lars.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import torch

from _hooks import Step, after, hooked, optimizer_for, run
from normhooks import GradientLARS

WEIGHT_DECAY = 1e-4


def naive_lars_(params: list[torch.Tensor]) -> None:
    """The per-parameter loop most hand-written LARS hooks use: several kernels per tensor."""
    for param in params:
        grad = param.grad
        w_norm = torch.linalg.vector_norm(param)
        g_norm = torch.linalg.vector_norm(grad)
        rate = torch.where(w_norm > 1e-2, w_norm / (1e-9 + g_norm + WEIGHT_DECAY * w_norm), 1.0)
        grad.add_(param, alpha=WEIGHT_DECAY).mul_(rate)


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    return {
        "SGD alone": optimizer_for(shapes, device).step,
        "GradientLARS + SGD": hooked(optimizer_for(shapes, device), GradientLARS()),
        f"GradientLARS(wd={WEIGHT_DECAY}) + SGD": hooked(
            optimizer_for(shapes, device), GradientLARS(weight_decay=WEIGHT_DECAY)
        ),
        f"naive loop(wd={WEIGHT_DECAY}) + SGD": after(naive_lars_, optimizer_for(shapes, device)),
    }


if __name__ == "__main__":
    run(__doc__, "SGD alone", candidates)
