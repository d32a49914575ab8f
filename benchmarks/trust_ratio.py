"""TrustRatio's cost on top of AdamW, side by side with the LAMB optimizers users pick instead.

Prints ``(TrustRatio + AdamW(foreach)) / AdamW(foreach)`` and ``LAMB / AdamW(foreach)`` on
real models' parameter shapes, measured in one run, for these LAMBs: pytorch-optimizer's
``Lamb`` (with ``adam_debias=True``, the bias correction of TrustRatio + AdamW) in its
multi-tensor and its per-tensor mode; timm's ``Lamb`` (gradient clipping off,
``always_adapt=True``: the same maths) when timm imports, and otherwise a multi-tensor LAMB
step written here from the paper (arXiv:1904.00962, Algorithm 2 with bias correction),
labelled as such.

    python benchmarks/trust_ratio.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _timing import print_ratios, time_side_by_side
from normhooks import TrustRatio

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {"ResNet-50": "resnet50_shapes.json", "ViT-B/16": "vitb16_shapes.json"}
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


def pytorch_optimizer_lamb(
    foreach: bool,
) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    from pytorch_optimizer import Lamb

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return Lamb(
            params,
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            adam_debias=True,
            foreach=foreach,
        )

    return make


def lamb_peer() -> tuple[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    try:
        from timm.optim import Lamb
    except ImportError:
        return "LAMB from the paper (foreach, no timm)", lambda p: PaperLamb(p, lr=LR)

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return Lamb(
            params,
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            max_grad_norm=None,
            always_adapt=True,
            foreach=True,
        )

    return "timm Lamb (foreach)", make


def optimizer_for(
    shapes: list[list[int]],
    device: torch.device,
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, device=device))
        param.grad = torch.randn(shape, device=device)
        params.append(param)
    optimizer = make(params)
    optimizer.step()  # creates the optimizer's state outside the timed region
    return optimizer


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", type=Path, default=SHAPES, help="folder of shape files")
    args = parser.parse_args()
    device = torch.device(args.device)
    peer_name, make_peer = lamb_peer()
    print(
        f"TrustRatio + AdamW(foreach) and LAMB optimizers vs AdamW(foreach) alone on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    for title, file in SETS.items():
        shapes = json.loads((args.shapes / file).read_text())
        plain = optimizer_for(shapes, device, adamw)
        plain_again = optimizer_for(shapes, device, adamw)
        hooked = optimizer_for(shapes, device, adamw)
        TrustRatio().attach(hooked)
        peer = optimizer_for(shapes, device, make_peer)
        multi_tensor = optimizer_for(shapes, device, pytorch_optimizer_lamb(foreach=True))
        per_tensor = optimizer_for(shapes, device, pytorch_optimizer_lamb(foreach=False))
        times = time_side_by_side(
            {
                "AdamW alone": plain.step,
                "AdamW alone, again (noise)": plain_again.step,
                "TrustRatio + AdamW": hooked.step,
                "pytorch-optimizer Lamb (foreach)": multi_tensor.step,
                "pytorch-optimizer Lamb (per tensor)": per_tensor.step,
                peer_name: peer.step,
            },
            device,
            args.repeats,
        )
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{title}: {len(shapes)} tensors, {count:,} values", times, "AdamW alone")
        del plain, plain_again, hooked, peer, multi_tensor, per_tensor


if __name__ == "__main__":
    main()
