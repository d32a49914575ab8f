"""Side-by-side timing for the benchmarks: interleaved runs, median ratios."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping

import torch
from torch.nn.utils import parametrize


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_side_by_side(
    candidates: Mapping[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int = 2,
    calls: int = 1,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in interleaved rounds.

    Interleaving puts every candidate under the same machine noise, so their ratios mean
    more than any absolute time. Each sample times ``calls`` calls between two
    synchronizations, so that on a GPU the host's launches of one call overlap the device's
    work of the one before, as in a training loop.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def interleaved_rounds(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int,
    calls: int,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate in each of ``rounds`` rounds, host clock only.

    A round times ``calls`` back-to-back calls of every candidate, in an order shuffled from
    one round to the next (seeded: the same orders every run), so that each candidate meets
    the machine's slow moments as often as the others and follows a different one from round
    to round: a candidate's first call after a heavy one starts with cold caches, and a
    rotated order would put the same neighbour before it in every round. For code whose cost
    is all on the host (nothing to synchronize): the CPU proxy of GPU host time.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    names = list(candidates)
    samples: dict[str, list[float]] = {name: [] for name in names}
    orders = random.Random(0)
    for _ in range(rounds):
        for name in orders.sample(names, len(names)):
            fn = candidates[name]
            start = clock()
            for _ in range(calls):
                fn()
            samples[name].append((clock() - start) / calls)
    return samples


def print_ratios(title: str, times: Mapping[str, float], baseline: str) -> None:
    base = times[baseline]
    print(f"\n{title}")
    width = max(len(name) for name in times)
    for name, seconds in times.items():
        print(f"  {name:<{width}}  {seconds * 1e3:9.2f} ms  {seconds / base:6.3f}x")


def compare_models(
    title: str,
    models: Mapping[str, torch.nn.Module],
    x: torch.Tensor,
    target: torch.Tensor,
    device: torch.device,
    repeats: int,
    *,
    reads: int = 4,
) -> None:
    """Prints the ratios of ``models`` to the one named "plain", in four patterns.

    - train step: forward, cross-entropy backward and an SGD(momentum) step;
    - eval forward: a model already in eval mode, under ``torch.no_grad()``;
    - predict function: ``model.eval()`` then a ``no_grad`` forward at every call, the usual
      way inference is wrapped (eval on a model already in eval mode must cost nothing);
    - cached scope: ``reads`` forwards inside one ``torch.nn.utils.parametrize.cached()``
      block, the inference loop torch's scoped cache is for (each weight computed once).
    """
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()
    }

    def train_step(name: str) -> Callable[[], None]:
        def run() -> None:
            optimizers[name].zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(models[name](x), target).backward()
            optimizers[name].step()

        return run

    def eval_forward(name: str) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                models[name](x)

        return run

    def predict(name: str) -> Callable[[], None]:
        def run() -> None:
            model = models[name]
            model.eval()
            with torch.no_grad():
                model(x)

        return run

    def cached_scope(name: str) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), parametrize.cached():
                for _ in range(reads):
                    models[name](x)

        return run

    for model in models.values():
        model.train()
    train = time_side_by_side({n: train_step(n) for n in models}, device, repeats)
    print_ratios(f"{title}: train step (forward + backward + SGD)", train, "plain")
    for model in models.values():
        model.eval()
    patterns = [
        ("eval forward (no_grad)", eval_forward),
        ("predict function (model.eval() + no_grad at each call)", predict),
        (f"{reads} eval forwards in one parametrize.cached() scope", cached_scope),
    ]
    for label, pattern in patterns:
        times = time_side_by_side({n: pattern(n) for n in models}, device, repeats * 3)
        print_ratios(f"{title}: {label}", times, "plain")
