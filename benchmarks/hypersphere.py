"""Hypersphere's cost on top of AdamW, beside nGPT's own normalization written after the step.

Prints ``(Hypersphere + AdamW(foreach)) / AdamW(foreach)`` and the same for the loop NVIDIA/ngpt
runs after each step (``normalize_matrices``: ``w.copy_(w / w.norm(dim=d, keepdim=True))`` for
each matrix), on real models' parameter shapes, rows (``dim=1``) and columns (``dim=0``),
measured in one run.

    python benchmarks/hypersphere.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

import torch

from _hooks import SETS, Step, hooked, optimizer_for, run
from normhooks import Hypersphere


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)


def then_normalized(optimizer: torch.optim.Optimizer, dim: int) -> Step:
    """The optimizer's step, then nGPT's loop over the matrices (what a user writes today)."""
    matrices = [p for p in optimizer.param_groups[0]["params"] if p.ndim >= 2]

    def step() -> None:
        optimizer.step()
        with torch.no_grad():
            for w in matrices:
                flat = w.view(w.shape[0], -1)
                flat.copy_(flat / flat.norm(p=2, dim=dim, keepdim=True))

    return step


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    return {
        "AdamW alone": optimizer_for(shapes, device, adamw).step,
        "AdamW alone, again (noise)": optimizer_for(shapes, device, adamw).step,
        "Hypersphere(dim=1) + AdamW": hooked(optimizer_for(shapes, device, adamw), Hypersphere()),
        "nGPT's loop, rows": then_normalized(optimizer_for(shapes, device, adamw), 1),
        "Hypersphere(dim=0) + AdamW": hooked(
            optimizer_for(shapes, device, adamw), Hypersphere(dim=0)
        ),
        "nGPT's loop, columns": then_normalized(optimizer_for(shapes, device, adamw), 0),
    }


if __name__ == "__main__":
    run(
        __doc__, "AdamW alone", candidates, {name: SETS[name] for name in ("ResNet-50", "ViT-B/16")}
    )
