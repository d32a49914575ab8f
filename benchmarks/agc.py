"""AdaptiveGradientClipping's cost on top of SGD, side by side, on real models' parameter shapes.

Prints ``(hook + SGD(momentum, foreach=True)) / SGD alone`` for normhooks' AGC, for the
per-parameter loop AGC is usually written as (timm's ``adaptive_clip_grad`` has that shape;
the loop here is written from the paper's formula) and for GradientLARS, whose passes over
the data are the same (two norms and a multiply), measured in one run. On CUDA, AGC runs as
two Triton launches per step; the row "kernels off" is its plain torch formula there.

    python benchmarks/agc.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import torch

from _hooks import Step, after, hooked, optimizer_for, run
from normhooks import AdaptiveGradientClipping, GradientLARS, set_kernels_enabled

CLIPPING = 0.01
EPS = 1e-3
# Gradients small enough that about half the units are clipped: both branches do real work.
GRAD_SCALE = 0.01


def per_parameter_agc_(params: list[torch.Tensor]) -> None:
    """One parameter at a time: unit norms, threshold, clipped copy, select, write back."""
    for param in params:
        grad = param.grad
        dims = tuple(range(1, param.ndim)) if param.ndim > 1 else None
        max_norm = torch.linalg.vector_norm(param, dim=dims, keepdim=True).clamp_(min=EPS)
        max_norm.mul_(CLIPPING)
        g_norm = torch.linalg.vector_norm(grad, dim=dims, keepdim=True)
        clipped = grad * (max_norm / g_norm.clamp(min=1e-6))
        grad.copy_(torch.where(g_norm < max_norm, grad, clipped))


def kernels_off(step: Step) -> Step:
    """``step`` with normhooks' kernels switched off: the plain torch formula."""

    def plain() -> None:
        with set_kernels_enabled(False):
            step()

    return plain


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    def sgd() -> torch.optim.Optimizer:
        return optimizer_for(shapes, device, grad_scale=GRAD_SCALE)

    steps = {
        "SGD alone": sgd().step,
        "SGD alone, again (noise)": sgd().step,
        "AdaptiveGradientClipping + SGD": hooked(sgd(), AdaptiveGradientClipping(CLIPPING, EPS)),
        "per-parameter loop + SGD": after(per_parameter_agc_, sgd()),
        "GradientLARS + SGD (the peer hook)": hooked(sgd(), GradientLARS()),
    }
    if device.type == "cuda":
        agc = hooked(sgd(), AdaptiveGradientClipping(CLIPPING, EPS))
        steps["AdaptiveGradientClipping + SGD, kernels off"] = kernels_off(agc)
    return steps


if __name__ == "__main__":
    run(__doc__, "SGD alone", candidates)
