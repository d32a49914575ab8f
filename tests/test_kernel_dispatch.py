"""The library's CUDA dispatch to the Triton kernels, exercised on the CPU.

``_kernels.available`` is true only for CUDA tensors, except inside
``_kernels.route_cpu_tensors()``, which sends CPU tensors down the same path. Triton's
interpreter runs the kernels on them (conftest sets ``TRITON_INTERPRET=1`` without a GPU), so
the code that hands layers and optimizer steps to the kernels is tested against the eager
paths that run everywhere else.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

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


ENTRY_POINTS = (
    "planned_weight_norm",
    "fuse_weight_norms",
    "planned_standardization",
    "standardize_rows",
    "fuse_standardizations",
    "lars_unit_",
)
# The entry points a model's weights take: each layer's own, or the model's fused launch
# (the tree conversions fuse; tests/test_fusion.py tests that).
WN_ENTRIES = ("planned_weight_norm", "fuse_weight_norms")
WS_ENTRIES = ("planned_standardization", "standardize_rows", "fuse_standardizations")


def weight_calls(calls: dict[str, int], entries: tuple[str, ...]) -> int:
    return sum(calls[name] for name in entries)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of each kernel entry point; the tests turn the routing on themselves."""
    calls = dict.fromkeys(ENTRY_POINTS, 0)

    def counting(name: str, entry: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def count(*args: object, **kwargs: object) -> torch.Tensor:
            calls[name] += 1
            return entry(*args, **kwargs)

        return count

    for name in ENTRY_POINTS:
        monkeypatch.setattr(_kernels, name, counting(name, getattr(_kernels, name)))
    return calls


def cnn(dtype: torch.dtype) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(6 * 6 * 6, 3),
    ).to(dtype)


def forward_backward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.square().sum().backward()
    return out


@pytest.mark.parametrize("scaled", [False, True], ids=["ws", "scaled-ws"])
def test_weight_standardization_through_the_kernel(
    kernel_calls: dict[str, int], scaled: bool
) -> None:
    gamma = 1.3 if scaled else 1.0
    eager = apply_weight_standardization(cnn(torch.float64), scaled=scaled, gamma=gamma)
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    expected = forward_backward(eager, x)
    assert weight_calls(kernel_calls, WS_ENTRIES) == 0
    with _kernels.route_cpu_tensors():
        out = forward_backward(fused, x)
    assert weight_calls(kernel_calls, WS_ENTRIES) > 0
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("eps", [1e-12, 0.0, 0.5])
def test_weight_norm_through_the_kernel(kernel_calls: dict[str, int], eps: float) -> None:
    eager = apply_weight_norm(cnn(torch.float64), eps=eps)
    with torch.no_grad():
        eager[0].parametrizations.weight.original1[1].zero_()  # a zero row
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    expected = forward_backward(eager, x)
    assert weight_calls(kernel_calls, WN_ENTRIES) == 0
    with _kernels.route_cpu_tensors():
        out = forward_backward(fused, x)
    assert weight_calls(kernel_calls, WN_ENTRIES) > 0
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad)


def test_weight_norm_of_the_output_axis_through_the_kernel(kernel_calls: dict[str, int]) -> None:
    eager = weight_norm(nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2).double(), dim=1)
    fused = copy.deepcopy(eager)
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    expected = forward_backward(eager, x)
    with _kernels.route_cpu_tensors():
        out = forward_backward(fused, x)
    assert kernel_calls["planned_weight_norm"] == 1
    torch.testing.assert_close(out, expected)
    for a, b in zip(fused.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_lars_step_through_the_kernel(kernel_calls: dict[str, int], weight_decay: float) -> None:
    model = cnn(torch.float32)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 2, 5, 5)

    def train(m: nn.Module) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(lars_param_groups(m), lr=0.1, momentum=0.9)
        hook = GradientLARS(weight_decay=weight_decay)
        hook.attach(optimizer)
        for _ in range(2):
            optimizer.zero_grad()
            m(x).square().mean().backward()
            optimizer.step()
        return hook.last_rates

    expected = train(reference)
    assert kernel_calls["lars_unit_"] == 0
    with _kernels.route_cpu_tensors():
        rates = train(model)
    assert kernel_calls["lars_unit_"] > 0
    for a, b in zip(rates, expected, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_lars_kernel_under_fused_grad_scaler(kernel_calls: dict[str, int]) -> None:
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

    train(reference, False)
    assert kernel_calls["lars_unit_"] == 0
    with _kernels.route_cpu_tensors():
        train(model, True)
    assert kernel_calls["lars_unit_"] > 0
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_dtype_change_between_steps_regroups_the_kernels_tensors(
    kernel_calls: dict[str, int],
) -> None:
    """One launch takes one dtype: a parameter converted with ``.data`` between steps (as
    ``module.double()`` does) goes to a launch of its own, not into the float32 one."""

    def train(routed: bool) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=generator)) for s in [(4, 3), (5,), (2, 2)]]
        optimizer = torch.optim.SGD(params, lr=0.1)
        GradientLARS().attach(optimizer)
        for step in range(2):
            if step == 1:
                params[0].data = params[0].data.double()
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if routed:
                with _kernels.route_cpu_tensors():
                    optimizer.step()
            else:
                optimizer.step()
        return [p.detach() for p in params]

    expected = train(routed=False)
    got = train(routed=True)
    assert kernel_calls["lars_unit_"] == 3  # one launch pair at the first step, two at the second
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
