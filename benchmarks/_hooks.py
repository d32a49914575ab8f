"""What the gradient-hook benchmarks share: the shape sets, their optimizers, the run.

Each benchmark names its candidates (an optimizer's step, with or without a hook, or a loop
written by hand before the step) for one set of parameter shapes; :func:`run` parses the
common arguments, builds the candidates for every set and prints their ratios to the
baseline, timed side by side.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from _timing import print_ratios, time_side_by_side

SHAPES = Path(__file__).resolve().parent / "shapes"
SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Step = Callable[[], object]
Candidates = Callable[[list[list[int]], torch.device], Mapping[str, Step]]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum and multi-tensor ops: the gradient hooks' baseline."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def optimizer_for(
    shapes: list[list[int]],
    device: torch.device,
    make: Make = sgd,
    grad_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """``make`` over random parameters of ``shapes`` with random gradients times
    ``grad_scale``, after one step (its state is created outside the timed region)."""
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(shape, device=device))
        param.grad = torch.randn(shape, device=device) * grad_scale
        params.append(param)
    optimizer = make(params)
    optimizer.step()
    return optimizer


def hooked(optimizer: torch.optim.Optimizer, hook: object) -> Step:
    """The step of ``optimizer`` with ``hook`` (a StepHook) attached."""
    hook.attach(optimizer)  # type: ignore[attr-defined]
    return optimizer.step


def after(rewrite_: Callable[[list[torch.Tensor]], None], optimizer: torch.optim.Optimizer) -> Step:
    """A step that runs ``rewrite_`` on the parameters (no grad), then ``optimizer``'s step:
    a technique written by hand as a loop before the step."""
    params = optimizer.param_groups[0]["params"]

    def step() -> None:
        with torch.no_grad():
            rewrite_(params)
        optimizer.step()

    return step


def run(doc: str, baseline: str, candidates: Candidates, sets: Mapping[str, str] = SETS) -> None:
    """Times ``candidates(shapes, device)`` on every shape set and prints their ratios to the
    one named ``baseline``; ``doc`` is the benchmark's docstring, whose first line heads the
    output."""
    title = doc.splitlines()[0]
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", type=Path, default=SHAPES, help="folder of shape files")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"{title.rstrip('.')} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    for name, file in sets.items():
        shapes = json.loads((args.shapes / file).read_text())
        steps = candidates(shapes, device)
        times = time_side_by_side(steps, device, args.repeats)
        count = sum(torch.Size(s).numel() for s in shapes)
        print_ratios(f"{name}: {len(shapes)} tensors, {count:,} values", times, baseline)
        # The next set's tensors are allocated once these are freed.
        del steps
