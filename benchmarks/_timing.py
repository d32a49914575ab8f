"""Side-by-side timing for the benchmarks: interleaved runs, median ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_side_by_side(
    candidates: Mapping[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in interleaved rounds.

    Interleaving puts every candidate under the same machine noise, so their ratios mean
    more than any absolute time.
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
            fn()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


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
) -> None:
    """Prints train-step and eval-forward ratios of ``models`` to the one named "plain".

    Train step: forward, cross-entropy backward and an SGD(momentum) step. Eval forward: eval
    mode under ``torch.no_grad()``, as inference runs.
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

    for model in models.values():
        model.train()
    train = time_side_by_side({n: train_step(n) for n in models}, device, repeats)
    print_ratios(f"{title}: train step (forward + backward + SGD)", train, "plain")
    for model in models.values():
        model.eval()
    evaluation = time_side_by_side({n: eval_forward(n) for n in models}, device, repeats * 3)
    print_ratios(f"{title}: eval forward (no_grad)", evaluation, "plain")
