"""Direct calls of the public functions and parametrization classes check their inputs.

Without the checks, torch's fused weight-norm op read g out of bounds and the standardization
of a 1-d tensor or with a negative eps returned zeros or NaN. Each bad input is tried on every
path a forward can take: the CPU fast path (float32), the plain formula (float16), compiled,
and the kernel dispatch (made to look available, so reaching it fails the test).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from normhooks import (
    ScaledWeightStandardization,
    WeightNorm,
    WeightStandardization,
    standardize_weight,
)

kernels = importlib.import_module("normhooks._kernels")

PATHS = ["fast", "formula", "compiled", "kernel"]


def run_on(path: str, fn: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fn`` as a forward on ``path`` would run it, and the dtype its tensors get there."""
    if path == "compiled":
        torch._dynamo.reset()
        return torch.compile(fn, backend="aot_eager"), torch.float32
    if path == "kernel":

        def unreachable(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the kernel was called with unchecked inputs")

        monkeypatch.setattr(kernels, "available", lambda tensor: True)
        monkeypatch.setattr(kernels, "fused_weight_norm", unreachable)
        monkeypatch.setattr(kernels, "standardize_rows", unreachable)
        return fn, torch.float32
    return fn, torch.float16 if path == "formula" else torch.float32


# --- weight normalization -------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("dim", "g_shape", "v_shape", "match"),
    [
        (0, (1, 1), (4, 2), r"g must have shape \[4, 1\] .* got g of shape \[1, 1\]"),
        (0, (4,), (4, 2), r"g must have shape \[4, 1\] .* got g of shape \[4\]"),
        (1, (4, 1), (4, 2), r"g must have shape \[1, 2\] .* got g of shape \[4, 1\]"),
        (None, (4, 1), (4, 2), r"g must be a single element for dim=None"),
        (0, (4,), (4,), r"v has 1 dimension; weight normalization needs a tensor with at least"),
        (
            2,
            (4, 1),
            (4, 2),
            r"dim must be in \[-2, 1\] for v of shape \[4, 2\] with 2 dimensions, got dim=2",
        ),
    ],
    ids=["g-one-row", "g-flat", "g-other-axis", "g-whole", "v-1d", "dim-range"],
)
def test_weight_norm_refuses_shapes_it_would_misread(
    path: str,
    dim: int | None,
    g_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn, dtype = run_on(path, WeightNorm(dim=dim), monkeypatch)
    with pytest.raises(ValueError, match=match):
        fn(torch.full(g_shape, 2.0, dtype=dtype), torch.randn(v_shape, dtype=dtype))


@pytest.mark.parametrize(
    ("g", "v", "error", "match"),
    [
        (torch.ones(4, 1), torch.ones(4, 2, dtype=torch.int64), TypeError, r"v must be a real .*"),
        (torch.ones(4, 1, dtype=torch.int32), torch.ones(4, 2), TypeError, r"g must be a real"),
        ([[1.0]] * 4, torch.ones(4, 2), TypeError, r"g must be a torch\.Tensor, got list"),
        (torch.ones(4, 1), "v", TypeError, r"v must be a torch\.Tensor, got str"),
    ],
    ids=["v-int", "g-int", "g-list", "v-str"],
)
def test_weight_norm_refuses_what_is_not_a_float_tensor(
    g: object, v: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        WeightNorm()(g, v)


@pytest.mark.parametrize("path", ["fast", "formula", "compiled"])
def test_weight_norm_of_a_g_in_another_dtype_computes_in_the_wider_one(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fn, dtype = run_on(path, WeightNorm(), monkeypatch)
    g = torch.rand(4, 1, dtype=torch.float64) + 0.5
    v = torch.randn(4, 3, dtype=dtype)
    expected = g * v.double() / v.double().norm(dim=1, keepdim=True)
    result = fn(g, v)
    assert result.dtype == dtype
    torch.testing.assert_close(result, expected.to(dtype))


def test_weight_norm_registered_on_a_vector_is_refused() -> None:
    with pytest.raises(ValueError, match=r"weight has 1 dimension; weight normalization needs"):
        parametrize.register_parametrization(nn.Linear(3, 2), "bias", WeightNorm())


# --- weight standardization -----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("weight_shape", "kwargs", "error", "match"),
    [
        ((5,), {}, ValueError, r"weight has 1 dimension; weight standardization needs a tensor"),
        ((), {}, ValueError, r"weight has 0 dimensions"),
        ((4, 3), {"eps": -1.0}, ValueError, r"eps must be positive, got eps=-1\.0"),
        ((4, 3), {"eps": float("nan")}, ValueError, r"eps must be finite, got eps=nan"),
        ((4, 3), {"eps": 0.0}, ValueError, r"eps must be positive, got eps=0\.0"),
        ((4, 3), {"eps": "1e-5"}, TypeError, r"eps must be a real number"),
        ((4, 3), {"dim": 2}, ValueError, r"dim must be in \[-2, 1\] for a weight of shape"),
        ((4, 3), {"groups": 0}, ValueError, r"groups must be positive"),
        ((4, 3), {"gain": torch.ones(3)}, ValueError, r"gain must have shape \[4\]"),
        ((4, 3), {"gain": torch.ones(1)}, ValueError, r"gain must have shape \[4\].*shape \[1\]"),
        ((4, 3), {"gain": torch.ones(4, 1)}, ValueError, r"gain must have shape \[4\]"),
        ((4, 3), {"gain": torch.ones(4, dtype=torch.int64)}, TypeError, r"gain must be a real"),
        ((4, 3), {"gain": [1.0] * 4}, TypeError, r"gain must be a torch\.Tensor, got list"),
    ],
    ids=[
        "1d",
        "0d",
        "eps-negative",
        "eps-nan",
        "eps-zero",
        "eps-str",
        "dim-range",
        "groups",
        "gain-short",
        "gain-broadcast",
        "gain-2d",
        "gain-int",
        "gain-list",
    ],
)
def test_standardize_weight_refuses_bad_arguments(
    path: str,
    weight_shape: tuple[int, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn, dtype = run_on(path, standardize_weight, monkeypatch)
    with pytest.raises(error, match=match):
        fn(torch.randn(weight_shape, dtype=dtype), **kwargs)


@pytest.mark.parametrize(
    ("weight", "error", "match"),
    [
        (torch.ones(4, 3, dtype=torch.int64), TypeError, r"weight must be a real .* integer"),
        (torch.ones(4, 3, dtype=torch.complex64), TypeError, r"weight must be a real .* complex"),
        ([[1.0, 2.0]], TypeError, r"weight must be a torch\.Tensor, got list"),
    ],
    ids=["int", "complex", "list"],
)
def test_standardize_weight_refuses_what_is_not_a_real_float_tensor(
    weight: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        standardize_weight(weight)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("make", "shape", "match"),
    [
        (WeightStandardization, (5,), r"weight has 1 dimension"),
        (lambda: WeightStandardization(dim=2), (4, 3), r"dim must be in \[-2, 1\]"),
        (
            lambda: WeightStandardization(dim=1, groups=4),
            (6, 3, 2),
            r"groups=4 splits axis 0 .* got dim=1 for a weight of shape \[6, 3, 2\]",
        ),
        (lambda: ScaledWeightStandardization(1), (4, 3), r"gain must have shape \[4\]"),
        (lambda: ScaledWeightStandardization(4), (5,), r"weight has 1 dimension"),
    ],
    ids=["ws-1d", "ws-dim", "ws-groups", "scaled-gain", "scaled-1d"],
)
def test_standardization_forward_refuses_a_weight_it_would_misread(
    path: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fn, dtype = run_on(path, make().to(torch.float16 if path == "formula" else None), monkeypatch)
    with pytest.raises(ValueError, match=match):
        fn(torch.randn(shape, dtype=dtype))
