"""Test helpers: the Chainer reference vectors and the comparisons they support."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

GOLDEN = Path(__file__).resolve().parent / "golden" / "chainer"


def golden_cases(kind: str) -> list[Any]:
    """The manifest's cases of one kind, as pytest params with readable ids.

    The vectors are part of the repository, so a missing manifest is an error, never a skip.
    """
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    cases = [c for c in manifest["cases"] if c["kind"] == kind]
    if not cases:
        raise LookupError(f"no Chainer reference case of kind {kind!r} in {GOLDEN}")
    return [pytest.param(case, id=case["name"]) for case in cases]


def load_arrays(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    with np.load(GOLDEN / case["file"]) as data:
        return {name: torch.from_numpy(data[name].copy()) for name in data.files}


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance the vectors support: 1e-12 in float64, 5e-6 in float32."""
    return 1e-12 if dtype == torch.float64 else 5e-6


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Compares within ``rel`` times the largest magnitude of ``expected`` (the README's rule)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=rel * max(scale, 1e-30))


def assert_compiled_training_matches_eager(
    model: torch.nn.Module,
    x: torch.Tensor,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    backend: str = "aot_eager",
    steps: int = 3,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Trains ``model`` and a copy for ``steps`` steps, eagerly and under torch.compile."""
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    eager_optimizer, compiled_optimizer = make_optimizer(model), make_optimizer(compiled)

    def step(m: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    compiled_step = torch.compile(step, backend=backend)
    for _ in range(steps):
        torch.testing.assert_close(
            compiled_step(compiled, compiled_optimizer),
            step(model, eager_optimizer),
            rtol=rtol,
            atol=atol,
        )
    for a, b in zip(model.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


def assert_grad_scaler_matches_unscaled(
    model: torch.nn.Module,
    x: torch.Tensor,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    make_reference_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    rtol: float,
    atol: float,
) -> None:
    """Three steps through torch.amp.GradScaler equal three plain steps on a copy."""
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(x.device.type, init_scale=2.0**10)
    optimizer, reference_optimizer = make_optimizer(model), make_reference_optimizer(reference)
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        reference_optimizer.zero_grad()
        reference(x).square().mean().backward()
        reference_optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# Every kind of weighted layer, by readable id: the reparametrizations must handle them all.
# Every kind of weighted layer, by readable id: the reparametrizations must handle them all.
LAYERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(5, 4),
    "bilinear": lambda: nn.Bilinear(3, 4, 2),
    "embedding": lambda: nn.Embedding(6, 4),
    "conv1d": lambda: nn.Conv1d(3, 4, 3),
    "conv2d": lambda: nn.Conv2d(3, 4, 3, padding=1),
    "conv2d-grouped": lambda: nn.Conv2d(4, 6, 3, groups=2),
    "conv3d": lambda: nn.Conv3d(2, 3, 2),
    "deconv1d": lambda: nn.ConvTranspose1d(3, 4, 3, stride=2),
    "deconv2d": lambda: nn.ConvTranspose2d(3, 4, 3, stride=2),
    "deconv2d-grouped": lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
    "deconv3d": lambda: nn.ConvTranspose3d(2, 3, 2),
}


def input_for(layer: nn.Module, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    if isinstance(layer, nn.Embedding):
        return (torch.tensor([[0, 3, 5], [1, 1, 2]]),)
    if isinstance(layer, nn.Bilinear):
        return (torch.randn(2, 3, dtype=dtype), torch.randn(2, 4, dtype=dtype))
    if isinstance(layer, nn.Linear):
        return (torch.randn(2, 5, dtype=dtype),)
    assert isinstance(layer, nn.modules.conv._ConvNd)
    spatial = (5,) * len(layer.kernel_size)
    return (torch.randn(2, layer.in_channels, *spatial, dtype=dtype),)


def small_cnn() -> nn.Sequential:
    """Every layer kind the reparametrizations convert by default, small enough for float64:
    a convolution, a transposed convolution, a strided convolution and a lazy linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 2, stride=2),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
