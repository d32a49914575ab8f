"""Norms on the CPU within 1e-5 of float64, on every path, up to 1e8 elements.

torch's CPU reductions sum a long float32 tensor in a few float32 partial sums, whose error
grows with the length. Equal values are the hardest case (every partial sum rounds the same
way), and cheap to make at 1e8 elements: the norms of one such tensor are checked directly
on every ``foreach`` mode and dtype, and each technique's rates or ratios on every path at
2**20 elements, where every former path was off by more than 1e-5. References are float64
sums of squares taken in chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from normhooks import AdaptiveGradientClipping, GradientLARS, TrustRatio, agc_, lars_
from normhooks._step_hook import euclidean_norms

TARGET = 1e-5
HUGE = 10**8
LARGE = (1 << 20) + 3  # not a multiple of the row length either
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"]
)
FOREACH = pytest.mark.parametrize("foreach", [None, True, False], ids=["auto", "foreach", "loop"])


def norm64(tensor: Tensor) -> float:
    """The Euclidean norm in float64, summed in chunks (no float64 copy of a huge tensor)."""
    flat = tensor.reshape(-1)
    return math.sqrt(sum(c.double().square().sum().item() for c in flat.split(1 << 22)))


def assert_relative(actual: Tensor, expected: list[float]) -> None:
    got = actual.double()
    want = torch.tensor(expected, dtype=torch.float64)
    errors = ((got - want).abs() / want).tolist()
    assert max(errors) <= TARGET, f"relative errors {errors} above {TARGET}"


# --- the shared norms, at 1e8 elements ---------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[torch.float32, torch.float16, torch.bfloat16],
    ids=["f32", "f16", "bf16"],
)
def huge(request: pytest.FixtureRequest) -> Iterator[tuple[Tensor, list[float]]]:
    """1e8 equal values, and the float64 norms of its two halves."""
    tensor = torch.full((HUGE,), 0.1, dtype=request.param)
    yield tensor, [norm64(half) for half in tensor.view(2, -1)]
    del tensor


@FOREACH
def test_whole_tensor_norms_of_1e8_elements(
    foreach: bool | None, huge: tuple[Tensor, list[float]]
) -> None:
    tensor, halves = huge
    short, medium = torch.full((3,), 2.0, dtype=tensor.dtype), torch.rand(5000).to(tensor.dtype)
    norms = euclidean_norms([short, tensor, medium], foreach)
    assert norms.dtype == torch.float32
    assert_relative(norms, [norm64(short), math.hypot(*halves), norm64(medium)])


def test_row_norms_of_rows_of_5e7_elements(huge: tuple[Tensor, list[float]]) -> None:
    """AGC's units: rows along dim 0, here two very long ones."""
    from normhooks._step_hook import row_norms

    tensor, halves = huge
    norms = row_norms(tensor.view(2, -1))
    assert norms.dtype == torch.float32
    assert_relative(norms, halves)


# --- every technique's values on every path, at 2**20 elements --------------------------------


def params_and_grads(dtype: torch.dtype) -> list[nn.Parameter]:
    """A long vector and a matrix with long rows, equal values, gradients 3x the weights."""
    params = [
        nn.Parameter(torch.full((LARGE,), 0.1, dtype=dtype)),
        nn.Parameter(torch.full((2, LARGE // 2), 0.2, dtype=dtype)),
    ]
    for param in params:
        param.grad = torch.full_like(param, 0.3)
    return params


def lars_expected(params: list[nn.Parameter]) -> list[float]:
    return [norm64(p) / (1e-9 + norm64(p.grad)) for p in params]


def agc_expected(params: list[nn.Parameter]) -> list[float]:
    """Each parameter's largest ||G_i|| / max(||W_i||, eps): rows for the matrix."""
    vector, matrix = params
    row_ratios = [norm64(g) / norm64(w) for w, g in zip(matrix, matrix.grad, strict=True)]
    return [norm64(vector.grad) / norm64(vector), max(row_ratios)]


# Each gradient technique with values: its functional form, its hook, the hook's attribute of
# the last step's values, and those values in float64.
WITH_VALUES = {
    "lars": (lars_, GradientLARS, "last_rates", lars_expected),
    "agc": (agc_, AdaptiveGradientClipping, "last_ratios", agc_expected),
}


@DTYPES
@FOREACH
@pytest.mark.parametrize("form", ["functional", "hook"])
@pytest.mark.parametrize("technique", list(WITH_VALUES))
def test_rates_and_ratios(
    technique: str, form: str, foreach: bool | None, dtype: torch.dtype
) -> None:
    functional, hook_class, attribute, expected_of = WITH_VALUES[technique]
    params = params_and_grads(dtype)
    expected = expected_of(params)
    if form == "functional":
        values = functional(params, foreach=foreach)
    else:
        hook = hook_class(foreach=foreach)
        optimizer = torch.optim.SGD(params, lr=0.0)
        hook.attach(optimizer)
        optimizer.step()
        (values,) = getattr(hook, attribute)
    assert_relative(values, expected)


@FOREACH
def test_trust_ratios(foreach: bool | None) -> None:
    """On plain SGD: ||w_old|| / (||w_new - w_old|| / lr), from the float32 step itself."""
    lr = 0.1
    params = params_and_grads(torch.float32)
    stepped = [p.detach() - lr * p.grad for p in params]  # what SGD(lr) computes, in float32
    expected = [
        norm64(p) / (norm64(s - p.detach()) / lr) for p, s in zip(params, stepped, strict=True)
    ]
    hook = TrustRatio(foreach=foreach)
    optimizer = torch.optim.SGD(params, lr=lr, foreach=foreach)
    hook.attach(optimizer)
    optimizer.step()
    (ratios,) = hook.last_ratios
    assert_relative(ratios, expected)


def test_float64_tensors_keep_float64_norms() -> None:
    tensor = torch.full((LARGE,), 0.1, dtype=torch.float64)
    norms = euclidean_norms([tensor])
    assert norms.dtype == torch.float64
    torch.testing.assert_close(norms, torch.tensor([norm64(tensor)], dtype=torch.float64))


@pytest.mark.parametrize("hook", [GradientLARS, AdaptiveGradientClipping], ids=["lars", "agc"])
def test_the_row_wise_cpu_norms_trace_without_graph_breaks(hook: type) -> None:
    torch._dynamo.reset()
    params = [nn.Parameter(torch.full((5000,), 0.1)), nn.Parameter(torch.full((3, 4100), 0.2))]
    for param in params:
        param.grad = torch.full_like(param, 0.3)
    expected = lars_expected(params) if hook is GradientLARS else agc_expected(params)
    instance = hook()
    optimizer = torch.optim.SGD(params, lr=0.1)
    instance.attach(optimizer)
    torch.compile(instance._pre_step, backend="aot_eager", fullgraph=True)(
        optimizer, (optimizer,), {}
    )
    assert_relative(instance._last_values[0], expected)
