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
