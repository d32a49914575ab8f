"""The library's CUDA dispatch to the Triton kernels, exercised on the CPU.

``_kernels.available`` is true only for CUDA tensors. Here it is forced true for CPU tensors,
which Triton's interpreter runs (conftest sets ``TRITON_INTERPRET=1`` without a GPU), so the
code that hands layers and optimizer steps to the kernels is tested against the eager paths
that run everywhere else.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the fused kernels need Triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    # conftest turns the interpreter on only without CUDA; on a GPU machine the same kernels
    # run on CUDA tensors in tests/test_cuda.py instead.
    pytest.skip(
        "runs the kernels on CPU tensors through Triton's interpreter", allow_module_level=True
    )

from normhooks import (
    GradientLARS,
    _kernels,
    apply_weight_norm,
    apply_weight_standardization,
    lars_param_groups,
    weight_norm,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture
def kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Routes every dispatch to the kernels, counting the times it was asked."""
    asked = [0]
    plain = (torch.Tensor, nn.Parameter)

    def available(tensor: torch.Tensor) -> bool:
        asked[0] += 1
        return type(tensor) in plain and not torch.compiler.is_compiling()

    monkeypatch.setattr(_kernels, "available", available)
    return asked


def cnn(dtype: torch.dtype) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(6 * 6 * 6, 3),
    ).to(dtype)


@pytest.mark.parametrize("scaled", [False, True], ids=["ws", "scaled-ws"])
def test_weight_standardization_through_the_kernel(kernels_on_cpu: list[int], scaled: bool) -> None:
    gamma = 1.3 if scaled else 1.0
    eager = apply_weight_standardization(cnn(torch.float64), scaled=scaled, gamma=gamma)
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernels, "available", lambda tensor: False)
        expected = eager(x)
        expected.square().sum().backward()
    asked = kernels_on_cpu[0]
    out = fused(x)
    out.square().sum().backward()
    assert kernels_on_cpu[0] > asked
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("eps", [1e-12, 0.0, 0.5])
def test_weight_norm_through_the_kernel(kernels_on_cpu: list[int], eps: float) -> None:
    eager = apply_weight_norm(cnn(torch.float64), eps=eps)
    with torch.no_grad():
        eager[0].parametrizations.weight.original1[1].zero_()  # a zero row
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernels, "available", lambda tensor: False)
        expected = eager(x)
        expected.square().sum().backward()
    asked = kernels_on_cpu[0]
    out = fused(x)
    out.square().sum().backward()
    assert kernels_on_cpu[0] > asked
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad)


def test_weight_norm_of_the_output_axis_through_the_kernel(kernels_on_cpu: list[int]) -> None:
    eager = weight_norm(nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2).double(), dim=1)
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernels, "available", lambda tensor: False)
        expected = eager(x)
        expected.square().sum().backward()
    out = fused(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_lars_step_through_the_kernel(kernels_on_cpu: list[int], weight_decay: float) -> None:
    model = cnn(torch.float32)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 2, 5, 5)

    def train(m: nn.Module, use_kernels: bool) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(lars_param_groups(m), lr=0.1, momentum=0.9)
        hook = GradientLARS(weight_decay=weight_decay)
        hook.attach(optimizer)
        with pytest.MonkeyPatch.context() as patch:
            if not use_kernels:
                patch.setattr(_kernels, "available", lambda tensor: False)
            for _ in range(2):
                optimizer.zero_grad()
                m(x).square().mean().backward()
                optimizer.step()
        return hook.last_rates

    rates = train(model, True)
    assert kernels_on_cpu[0] > 0
    expected = train(reference, False)
    for a, b in zip(rates, expected, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_lars_kernel_under_fused_grad_scaler(kernels_on_cpu: list[int]) -> None:
    """The kernel follows the hook base's protocol: unscaled results, grad_scale cleared."""
    model = cnn(torch.float32)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 2, 5, 5)

    def train(m: nn.Module, scaled: bool) -> None:
        optimizer = torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
        GradientLARS(weight_decay=1e-3).attach(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=scaled)
        for _ in range(2):
            optimizer.zero_grad()
            scaler.scale(m(x).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()

    train(model, True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernels, "available", lambda tensor: False)
        train(reference, False)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)
