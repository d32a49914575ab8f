"""Spectral normalization's cost per layer and on a ResNet-18, beside torch's spectral_norm.

Three sections, each side by side in one run, as ratios to the plain layer or model:

- layers: a train step (forward, backward, SGD(momentum)) of one layer of each kind with
  batch 8: plain, a second plain copy (the run's noise), normhooks' ``spectral_norm``, its
  σReparam (``scale=True``), and torch's ``torch.nn.utils.parametrizations.spectral_norm``;
  the last column is normhooks' added cost over torch's (1 means the same);
- host: the same train step on a ResNet-18 with GroupNorm at widths / 8, whose compute is
  negligible beside the host's work per layer (the CPU proxy of GPU host time; spectral
  norm has no kernels, so its GPU path is these same ops), with the added cost per layer;
- ResNet-18 (GroupNorm, 64x64): train step, eval forward, predict and cached scope.

    python benchmarks/sn.py [--repeats 10] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm as torch_spectral_norm

from _models import ResNet18
from _timing import compare_models, interleaved_rounds, time_side_by_side
from normhooks import apply_spectral_norm

LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Linear(512, 512)": (lambda: nn.Linear(512, 512), (8, 512)),
    "Linear(64, 64)": (lambda: nn.Linear(64, 64), (8, 64)),
    "Conv2d(64, 64, 3)": (lambda: nn.Conv2d(64, 64, 3, padding=1), (8, 64, 16, 16)),
    "Conv2d(8, 8, 3)": (lambda: nn.Conv2d(8, 8, 3, padding=1), (8, 8, 8, 8)),
    "ConvTranspose2d(64, 32, 4)": (
        lambda: nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1),
        (8, 64, 8, 8),
    ),
}


def on_every_weight(convert: Callable[[nn.Module], object], model: nn.Module) -> nn.Module:
    """``convert(layer)`` on every Linear, Conv* and ConvTranspose*, one layer at a time."""
    for module in list(model.modules()):
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            convert(module)
    return model


NAMES = [
    "plain",
    "plain, a second copy (noise)",
    "normhooks spectral_norm",
    "normhooks spectral_norm, scale=True",
    "torch spectral_norm",
]


def variants(plain: nn.Module) -> dict[str, nn.Module]:
    models = [
        plain,
        copy.deepcopy(plain),
        apply_spectral_norm(copy.deepcopy(plain)),
        apply_spectral_norm(copy.deepcopy(plain), scale=True),
        on_every_weight(torch_spectral_norm, copy.deepcopy(plain)),
    ]
    return dict(zip(NAMES, models, strict=True))


def train_step(model: nn.Module, x: Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    return run


def layers(repeats: int) -> None:
    print("\nlayers: train step (forward + backward + SGD), batch 8, ratio to plain")
    columns = ["noise", "normhooks", "normhooks scale=True", "torch", "added vs torch's"]
    print(f"  {'':<27}" + "".join(f"  {c:>21}" for c in columns))
    for label, (make, shape) in LAYERS.items():
        models = variants(make())
        x = torch.randn(shape)
        times = time_side_by_side(
            {n: train_step(m, x) for n, m in models.items()}, torch.device("cpu"), repeats * 5
        )
        base = times["plain"]
        added = (times["normhooks spectral_norm"] - base) / (times["torch spectral_norm"] - base)
        ratios = "".join(f"  {times[n] / base:20.3f}x" for n in NAMES[1:])
        print(f"  {label:<27}{ratios}  {added:20.3f}x")


def host(rounds: int, calls: int) -> None:
    plain = ResNet18(classes=10, width=8)
    models = variants(plain)
    count = sum(isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for m in plain.modules())
    x = torch.randn(2, 3, 32, 32)
    samples = interleaved_rounds({n: train_step(m, x) for n, m in models.items()}, rounds, calls)
    times = {name: statistics.median(values) for name, values in samples.items()}
    base = times["plain"]
    print(f"\nhost: ResNet-18 (GroupNorm) at widths / 8, batch 2, 32x32: {count} layers")
    for name, seconds in times.items():
        per_layer = (seconds - base) / count * 1e6
        print(
            f"  {name:<36}  {seconds * 1e3:8.3f} ms  {seconds / base:6.3f}x  "
            f"{per_layer:+8.1f} us/layer"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few repeats")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    torch.manual_seed(0)
    print(
        f"Spectral normalization, cpu, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    layers(repeats)
    host(rounds=3 if args.quick else 21, calls=2 if args.quick else 10)
    batch = 4 if args.quick else args.batch
    compare_models(
        "ResNet-18 (GroupNorm), 64x64",
        variants(ResNet18()),
        torch.randn(batch, 3, 64, 64),
        torch.randint(0, 100, (batch,)),
        torch.device("cpu"),
        repeats,
    )


if __name__ == "__main__":
    main()
