"""normhooks' GPU host time, measured on the CPU: the CUDA code path with a no-op Triton driver.

A GPU training step of a small model is host-bound: Python, dispatch and kernel launches take
longer than the GPU's work, so the host time per step is the step time. This benchmark
measures that host time without a GPU (see benchmarks/_proxy.py): CPU tensors take
normhooks' CUDA path, Triton's real ``JITFunction.run`` binds, specializes and looks up
kernels compiled for sm_90, and a driver whose launch is a no-op counts the launches.
Models are so narrow that their compute is negligible; medians of interleaved rounds.

Sections:

- models: a ResNet-18 with GroupNorm at a fraction of its widths, train step (forward,
  cross-entropy backward, SGD(momentum, foreach)): plain, a second plain copy (the noise),
  normhooks' weight normalization and weight standardization as the tree conversions give
  them (every weight in one fused launch each way) and converted one layer at a time (each
  layer's own kernels), torch's parametrizations.weight_norm, weight standardization as
  timm's batch_norm formulation, and the floors (an unchanged parametrization; one that
  multiplies by 1.0);
- hooks: the rows of ``_hooks.hook_rows``, which benchmarks/gpu.py times on a GPU too, on the
  parameter shapes of benchmarks/shapes/ with every dimension capped (the tensors' number
  and ranks are the model's, their compute negligible), one table per shape set, grouped
  per hook, each row against its optimizer alone: SGD(momentum, foreach) and AdamW(foreach)
  alone and their floors (empty step hooks; those hooks launching two empty Triton kernels,
  the least a kernel of a hook costs); GradientLARS, AdaptiveGradientClipping,
  GradientCentralization (on SGD) and TrustRatio (on AdamW), each beside its peers
  (pytorch-optimizer's LARS, agc, centralize_gradient and Lamb; timm's Lars,
  adaptive_clip_grad and Lamb where timm imports) and the loop a user writes by hand in a
  step pre-hook; then one line per hook against issue 26's target on ResNet-50 and ViT-B/16.

Each row gives the host time per step, its ratio to the baseline, the cost per layer or per
tensor, and the counts per step: aten ops reaching the backends (of which allocations and
views), Triton launches, autograd nodes (of which run Python in backward). Kernel outputs are
uninitialized memory under the proxy: nothing here compares numbers.

    python benchmarks/host.py [--rounds 21] [--only models] [--quick] [--profile NAME]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as torch_weight_norm

import _hooks
import _proxy
from _counts import Counts, count
from _models import (
    ResNet18,
    on_every_conv,
    on_every_matrix,
    parametrized_tensors,
    with_batch_norm_standardization,
    with_empty_parametrizations,
)
from _timing import interleaved_rounds
from normhooks import (
    apply_weight_norm,
    apply_weight_standardization,
    weight_norm,
    weight_standardization,
)

SHAPES = Path(__file__).resolve().parent / "shapes"
SHAPE_SETS = {
    "ResNet-50": "resnet50_shapes.json",
    "ViT-B/16": "vitb16_shapes.json",
    "1,200 small tensors": "many_small_shapes.json",
}
# Every dimension of the hooks' tensors is capped at this: the host's work per tensor stays,
# the compute goes.
SHAPE_CAP = 4
# The models' first-stage width (64 in ResNet-18): widths / 8.
WIDTH = 8
BATCH, SIZE, CLASSES = 2, 32, 10


@dataclass
class Candidate:
    """One row: what is timed, what it is compared with, and how many layers or tensors its
    extra cost is shared among."""

    step: Callable[[], object]
    counted: Callable[[], Tensor | None]  # the part that is counted (returns a loss, or None)
    baseline: str
    units: int
    group: str = ""  # the heading it is printed under


@dataclass
class Rounds:
    """How each table is timed: ``rounds`` interleaved rounds of ``calls`` steps per candidate,
    after ``warmup`` steps each."""

    rounds: int
    calls: int
    warmup: int = 3


def model_candidates(width: int) -> dict[str, Candidate]:
    torch.manual_seed(0)
    plain = ResNet18(classes=CLASSES, width=width)
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    target = torch.randint(0, CLASSES, (BATCH,))
    # Built and registered outside the proxy: registration computes real weights.
    models = {
        "plain": plain,
        "plain, a second copy (noise)": copy.deepcopy(plain),
        "normhooks apply_weight_norm (fused)": apply_weight_norm(copy.deepcopy(plain)),
        "normhooks weight_norm per layer (kernel path)": on_every_matrix(
            weight_norm, copy.deepcopy(plain)
        ),
        "torch parametrizations.weight_norm": on_every_matrix(
            torch_weight_norm, copy.deepcopy(plain)
        ),
        "normhooks apply_weight_standardization (fused)": apply_weight_standardization(
            copy.deepcopy(plain)
        ),
        "normhooks WS per layer (kernel path)": on_every_conv(
            weight_standardization, copy.deepcopy(plain)
        ),
        "batch_norm WS (timm's formulation)": with_batch_norm_standardization(copy.deepcopy(plain)),
        "floor: unchanged parametrization": with_empty_parametrizations(copy.deepcopy(plain)),
        "floor: x1.0 parametrization": with_empty_parametrizations(
            copy.deepcopy(plain), times_one=True
        ),
    }
    candidates = {}
    for name, model in models.items():
        model.train()
        # foreach, as torch picks on CUDA (on the CPU its default is the per-tensor loop).
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)

        def loss(model: nn.Module = model, optimizer: torch.optim.SGD = optimizer) -> Tensor:
            optimizer.zero_grad(set_to_none=True)
            return F.cross_entropy(model(x), target)

        def step(loss: Callable[[], Tensor] = loss, optimizer: torch.optim.SGD = optimizer) -> None:
            loss().backward()
            optimizer.step()

        candidates[name] = Candidate(step, loss, "plain", parametrized_tensors(model))
    return candidates


def parameters(shapes: Sequence[Sequence[int]]) -> list[nn.Parameter]:
    params = []
    for shape in shapes:
        small = [min(size, SHAPE_CAP) for size in shape]
        param = nn.Parameter(torch.randn(small))
        param.grad = torch.randn(small) * 0.01
        params.append(param)
    return params


def hook_candidates(
    shapes: Sequence[Sequence[int]],
) -> tuple[dict[str, Candidate], _hooks.HookTable]:
    """The rows of ``_hooks.hook_rows`` on ``shapes`` capped, and the table they come from
    (its notes; what must live as long as they do)."""
    # Imported once the interpreter is off (main): its kernel must compile, not be interpreted.
    import _floor

    table = _hooks.hook_rows(lambda: parameters(shapes), _floor.launcher(torch.device("cpu")))
    candidates = {}
    for name, row in table.rows.items():
        units = 0 if name in (row.baseline, _hooks.NOISE) else len(shapes)
        candidates[name] = Candidate(row.step, row.step, row.baseline, units, row.group)
    return candidates, table


def report(
    title: str, candidates: dict[str, Candidate], timing: Rounds, unit: str
) -> dict[str, float]:
    """Prints the table; returns each row's median ratio to its baseline."""

    def launches() -> int:
        return sum(_proxy.DRIVER.launches.values())

    counts: dict[str, Counts] = {name: count(c.counted, launches) for name, c in candidates.items()}
    # The thread's CPU time: what the OS gives other processes while this one waits for a core
    # stays out, and nothing in a step waits (no GPU, no I/O).
    samples = interleaved_rounds(
        {n: c.step for n, c in candidates.items()},
        timing.rounds,
        timing.calls,
        timing.warmup,
        clock=time.thread_time,
    )
    print(f"\n{title}")
    indent = "  " if any(c.group for c in candidates.values()) else ""
    width = max(len(name) for name in candidates) + len(indent)
    print(
        f"  {'':<{width}}  {'host/step':>10}  {'ratio':>6}  {'rounds':>11}  {'added':>9}"
        f"  {'per ' + unit:>10}  {unit + 's':>7}  {'ops':>5}  {'allocs':>6}  {'views':>5}"
        f"  {'launches':>8}  {'nodes':>5}  {'Python':>6}"
    )
    ratios: dict[str, float] = {}
    group = ""
    for name, candidate in candidates.items():
        if candidate.group != group:
            group = candidate.group
            print(f"  {group}")
        own, base = samples[name], samples[candidate.baseline]
        # Each round's candidate against its baseline of the same round, measured a moment
        # apart: the load of a shared machine drifts between rounds more than within one.
        round_ratios = sorted(v / b for v, b in zip(own, base, strict=True))
        low, high = round_ratios[len(own) // 4], round_ratios[(3 * len(own)) // 4]
        spread = f"{low:.2f}-{high:.2f}"
        added = statistics.median(v - b for v, b in zip(own, base, strict=True))
        added_text = "-" if name == candidate.baseline else f"{added * 1e6:.0f} us"
        per_unit = f"{added / candidate.units * 1e6:.1f} us" if candidate.units else "-"
        ratios[name] = statistics.median(round_ratios)
        c = counts[name]
        print(
            f"  {indent + name:<{width}}  {statistics.median(own) * 1e3:7.3f} ms"
            f"  {ratios[name]:5.2f}x  {spread:>11}  {added_text:>9}"
            f"  {per_unit:>10}  {candidate.units or '-':>7}  {c.ops:>5}  {c.allocations:>6}"
            f"  {c.views:>5}  {c.launches:>8}  {c.nodes or '-':>5}"
            f"  {c.python_nodes if c.nodes else '-':>6}"
        )
    return ratios


def profile(candidates: dict[str, Candidate], wanted: str, calls: int) -> None:
    """cProfile of ``calls`` steps of the candidate whose name contains ``wanted``."""
    matches = [name for name in candidates if wanted.lower() in name.lower()]
    if not matches:
        return
    name = matches[0]
    step = candidates[name].step
    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    print(f"\nProfile of {calls} steps of {name!r}, by own time:")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=5, help="model steps per round (hooks: x4)")
    parser.add_argument("--only", choices=["models", "hooks"], help="one section")
    parser.add_argument("--width", type=int, default=WIDTH, help="ResNet-18's first width")
    parser.add_argument("--quick", action="store_true", help="7 rounds (a GPU slot's section)")
    parser.add_argument(
        "--smoke", action="store_true", help="one round of one step: checks that it runs"
    )
    parser.add_argument("--profile", metavar="NAME", help="cProfile the candidate named so")
    args = parser.parse_args(argv)
    timing = Rounds(7 if args.quick else args.rounds, args.calls)
    if args.smoke:
        timing = Rounds(1, 1, warmup=1)
    _proxy.interpreter_off()
    threads = torch.get_num_threads()
    # One thread, as the host's Python runs; and no denormal slow paths in the garbage that
    # kernel outputs hold under the proxy.
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        measure(args, timing)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default; it has no getter
    return 0


def measure(args: argparse.Namespace, timing: Rounds) -> None:
    print(
        f"Host time per step: normhooks' CUDA path on CPU tensors (Triton {triton.__version__}, "
        f"sm_90, no-op launches), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
        f"medians of {timing.rounds} interleaved rounds, the thread's CPU time\n"
        "Counts per step (models: the forward and backward; hooks: the optimizer step): aten ops "
        "that compute, allocate, make views; Triton launches; autograd nodes, and those "
        "that run Python in backward. Ratio and added time: each round against its baseline."
    )
    with _proxy.cuda_path_on_cpu():
        if args.only in (None, "models"):
            candidates = model_candidates(args.width)
            title = (
                f"ResNet-18 (GroupNorm), widths / {64 // args.width}, batch {BATCH} at "
                f"{SIZE}x{SIZE}: train step (forward, backward, SGD(momentum, foreach))"
            )
            report(title, candidates, timing, "layer")
            if args.profile:
                profile(candidates, args.profile, timing.calls * timing.rounds)
        if args.only in (None, "hooks"):
            hooks = Rounds(timing.rounds, timing.calls * 4, timing.warmup)
            ratios = {}
            for name, file in SHAPE_SETS.items():
                shapes = json.loads((SHAPES / file).read_text())
                candidates, table = hook_candidates(shapes)
                title = (
                    f"{name} ({len(shapes)} tensors, dims capped at {SHAPE_CAP}): optimizer "
                    "step; each row against its optimizer alone"
                )
                ratios[name] = report(title, candidates, hooks, "tensor")
                for note in table.notes:
                    print(f"  ({note})")
                if args.profile:
                    profile(candidates, args.profile, hooks.calls * hooks.rounds)
                del candidates, table
            smoke = " (a smoke run: one step, not a measurement)" if args.smoke else ""
            print(f"\nIssue 26's targets on the proxy{smoke}:")
            for line in _hooks.verdicts(ratios):
                print(f"  {line}")


if __name__ == "__main__":
    sys.exit(main())
