"""TrustRatio's cost on top of AdamW, side by side with the LAMB optimizers users pick instead.

Prints ``(TrustRatio + AdamW(foreach)) / AdamW(foreach)`` and ``LAMB / AdamW(foreach)`` on
real models' parameter shapes and on many small tensors, measured in one run, for these
LAMBs: pytorch-optimizer's ``Lamb`` (``adam_debias=True``; the same work per step, not the
same numbers: its exact counterpart is ``TrustRatio(bias_correction=False,
max_weight_norm=10)`` on Adam, see docs/migrating/lamb.md) in its multi-tensor and its
per-tensor mode; timm's ``Lamb`` (gradient clipping off, ``always_adapt=True``: the same
maths) when timm imports, and otherwise a multi-tensor LAMB step written here from the paper
(arXiv:1904.00962, Algorithm 2 with bias correction), labelled as such. The floor is AdamW
with the passes over memory that a hook on any optimizer's update cannot do without, written
here with torch's multi-tensor ops: the copy before the step, the difference and a rescaling
after it, without the two sets of norms the trust ratio adds.

    python benchmarks/trust_ratio.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

from typing import Any

import torch

from _hooks import SETS, Make, Step, hooked, optimizer_for, run
from normhooks import TrustRatio

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-6, 1e-2


class PaperLamb(torch.optim.Optimizer):
    """LAMB from the paper with multi-tensor ops: the peer when timm is not installed.

    ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``, ``w -= lr * ||w|| / ||u|| * u`` (ratio 1
    where a norm is zero), one group of one device and dtype.
    """

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.steps += 1
        (group,) = self.param_groups
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            if not self.state[p]:
                self.state[p] = {"m": torch.zeros_like(p), "v": torch.zeros_like(p)}
        ms = [self.state[p]["m"] for p in params]
        vs = [self.state[p]["v"] for p in params]
        torch._foreach_lerp_(ms, grads, 1 - BETAS[0])
        torch._foreach_mul_(vs, BETAS[1])
        torch._foreach_addcmul_(vs, grads, grads, value=1 - BETAS[1])
        correction1 = 1 - BETAS[0] ** self.steps
        root_correction2 = (1 - BETAS[1] ** self.steps) ** 0.5
        denominators = torch._foreach_sqrt(vs)
        torch._foreach_div_(denominators, root_correction2)
        torch._foreach_add_(denominators, EPS)
        updates = torch._foreach_div(ms, denominators)
        torch._foreach_div_(updates, correction1)
        torch._foreach_add_(updates, params, alpha=WEIGHT_DECAY)
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(updates))
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
        torch._foreach_mul_(updates, list((-group["lr"] * ratio).unbind(0)))
        torch._foreach_add_(params, updates)


# The settings every LAMB here shares with TrustRatio + AdamW.
LAMB = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}


def pytorch_optimizer_lamb(foreach: bool) -> Make:
    from pytorch_optimizer import Lamb

    return lambda params: Lamb(params, **LAMB, adam_debias=True, foreach=foreach)


def lamb_peer() -> tuple[str, Make]:
    try:
        from timm.optim import Lamb
    except ImportError:
        return "LAMB from the paper (foreach, no timm)", lambda p: PaperLamb(p, lr=LR)
    return "timm Lamb (foreach)", lambda params: Lamb(
        params, **LAMB, max_grad_norm=None, always_adapt=True, foreach=True
    )


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **LAMB, foreach=True)


def passes_floor(optimizer: torch.optim.Optimizer) -> Step:
    """``optimizer``'s step with the least an update hook moves through memory: each parameter
    copied before the step, then ``old - new`` and ``new += c * (old - new)`` after it (a
    constant ``c``: no norm is taken)."""
    params = optimizer.param_groups[0]["params"]
    olds = [torch.empty_like(p) for p in params]

    def copy_in(*_: object) -> None:
        with torch.no_grad():
            torch._foreach_copy_(olds, params)

    def rescale(*_: object) -> None:
        with torch.no_grad():
            torch._foreach_sub_(olds, params)
            torch._foreach_add_(params, olds, alpha=1e-3)

    optimizer.register_step_pre_hook(copy_in)
    optimizer.register_step_post_hook(rescale)
    return optimizer.step


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    peer_name, make_peer = lamb_peer()
    return {
        "AdamW alone": optimizer_for(shapes, device, adamw).step,
        "AdamW alone, again (noise)": optimizer_for(shapes, device, adamw).step,
        "TrustRatio + AdamW": hooked(optimizer_for(shapes, device, adamw), TrustRatio()),
        "AdamW + copy, difference, rescaling (floor)": passes_floor(
            optimizer_for(shapes, device, adamw)
        ),
        "pytorch-optimizer Lamb (foreach)": optimizer_for(
            shapes, device, pytorch_optimizer_lamb(foreach=True)
        ).step,
        "pytorch-optimizer Lamb (per tensor)": optimizer_for(
            shapes, device, pytorch_optimizer_lamb(foreach=False)
        ).step,
        peer_name: optimizer_for(shapes, device, make_peer).step,
    }


if __name__ == "__main__":
    run(__doc__, "AdamW alone", candidates, SETS)
