"""UpdateRMS's cost on top of AdamW and of pytorch-optimizer's Muon, beside the optimizers alone.

Prints ``(UpdateRMS("clip") + AdamW(foreach)) / AdamW(foreach)``, and, on the same shapes,
``Muon`` alone, ``UpdateRMS("match") + Muon`` and ``Muon(use_adjusted_lr=True)`` (Moonlight's
factor inside the optimizer, the peer of the matching rule) over AdamW, measured in one run.
Muon steps the tensors of two or more dimensions (flattened to matrices), AdamW the others.

    python benchmarks/update_rms.py [--device cuda] [--repeats 15]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _hooks import SETS, Step, hooked, optimizer_for, run
from normhooks import UpdateRMS


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True)


def muon(**settings: Any) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    from pytorch_optimizer import Muon

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        matrices = [p for p in params if p.ndim >= 2]
        others = [p for p in params if p.ndim < 2]
        groups = [{"params": matrices, "use_muon": True, "weight_decay": 1e-2}]
        if others:
            groups.append({"params": others, "use_muon": False, "update": False})
        return Muon(groups, lr=2e-2, foreach=True, **settings)  # type: ignore[arg-type]

    return make


def candidates(shapes: list[list[int]], device: torch.device) -> dict[str, Step]:
    return {
        "AdamW alone": optimizer_for(shapes, device, adamw).step,
        "AdamW alone, again (noise)": optimizer_for(shapes, device, adamw).step,
        'UpdateRMS("clip") + AdamW': hooked(optimizer_for(shapes, device, adamw), UpdateRMS()),
        "Muon alone": optimizer_for(shapes, device, muon()).step,
        'UpdateRMS("match") + Muon': hooked(
            optimizer_for(shapes, device, muon()), UpdateRMS("match")
        ),
        "Muon(use_adjusted_lr=True)": optimizer_for(
            shapes, device, muon(use_adjusted_lr=True)
        ).step,
    }


if __name__ == "__main__":
    run(
        __doc__, "AdamW alone", candidates, {name: SETS[name] for name in ("ResNet-50", "ViT-B/16")}
    )
