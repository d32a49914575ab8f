"""GradientCentralization and centralize_gradients_: the formula, which tensors and axes, its
peers and its settings. What every hook shares is in test_hook_contract.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorch_optimizer.optimizer.gradient_centralization import centralize_gradient
from torch import Tensor, nn

from normhooks import GradientCentralization, centralize_gradients_


def reference(grad: Tensor, conv_only: bool = False) -> Tensor:
    """Yong et al. 2020, eq. 4: ``G_i - mean(G_i)`` for each row ``G_i`` along dim 0 of a
    gradient of 2 or more dims (4 or more for GCC, their section 3.2), in float64."""
    g = grad.double()
    if g.ndim < (4 if conv_only else 2):
        return g
    rows = g.reshape(g.shape[0], -1)
    return (rows - rows.sum(1, keepdim=True) / rows.shape[1]).reshape(g.shape)


def param_with_grad(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    param = nn.Parameter(torch.randn(shape, dtype=dtype))
    param.grad = torch.randn(shape, dtype=dtype) + 0.5  # rows with a mean to remove
    return param


shapes = st.lists(st.integers(1, 5), min_size=0, max_size=5).map(tuple)


@settings(deadline=None, max_examples=80)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=5),
    conv_only=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    foreach=st.sampled_from([None, True, False]),
    seed=st.integers(0, 2**16),
)
def test_centralization_matches_the_formula(
    shape_list: list[tuple[int, ...]],
    conv_only: bool,
    dtype: torch.dtype,
    foreach: bool | None,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    params = [param_with_grad(*s, dtype=dtype) for s in shape_list]
    expected = [reference(p.grad, conv_only) for p in params]
    assert centralize_gradients_(params, conv_only, foreach=foreach) is None
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad.double(), grad, rtol=0, atol=tolerance)


@pytest.mark.parametrize("conv_only", [False, True], ids=["gc", "gcc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_equals_pytorch_optimizers_centralize_gradient(conv_only: bool, dtype: torch.dtype) -> None:
    """pytorch-optimizer's function, per tensor, on the same inputs."""
    params = [param_with_grad(*s, dtype=dtype) for s in [(6, 5), (4, 3, 3), (8, 3, 3, 3), (7,)]]
    theirs = [p.grad.clone() for p in params]
    for grad in theirs:
        centralize_gradient(grad, gc_conv_only=conv_only)
    centralize_gradients_(params, conv_only)
    for param, grad in zip(params, theirs, strict=True):
        torch.testing.assert_close(param.grad, grad)


LAYERS = {
    "linear": (lambda: nn.Linear(5, 4), (True, False)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), (True, False)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3), (True, True)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (True, True)),
    "deconv2d": (lambda: nn.ConvTranspose2d(3, 4, 3), (True, True)),
    "bias": (lambda: nn.LayerNorm(4), (False, False)),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("conv_only", [False, True], ids=["gc", "gcc"])
def test_which_weights_are_centralized(name: str, conv_only: bool) -> None:
    """GC: every weight of 2+ dims; GCC: the 4+ dim weights of 2-D and 3-D convolutions,
    transposed ones included; never a vector."""
    make, centralized = LAYERS[name]
    weight = make().weight
    weight.grad = torch.randn_like(weight) + 1.0
    before = weight.grad.clone()
    centralize_gradients_(weight, conv_only)
    if centralized[conv_only]:
        means = weight.grad.mean(dim=tuple(range(1, weight.ndim)))
        torch.testing.assert_close(means, torch.zeros_like(means), rtol=0, atol=1e-6)
    else:
        assert torch.equal(weight.grad, before)


def test_a_transposed_convolution_is_centralized_along_its_input_axis() -> None:
    """Dim 0 for every tensor, as the paper's code and pytorch-optimizer have it: a
    ConvTranspose2d weight is [in, out, kh, kw], so each input channel's row is centralized."""
    layer = nn.ConvTranspose2d(3, 5, 2)
    layer.weight.grad = torch.randn_like(layer.weight) + 1.0
    centralize_gradients_(layer.weight)
    per_input = layer.weight.grad.mean(dim=(1, 2, 3))
    per_output = layer.weight.grad.mean(dim=(0, 2, 3))
    torch.testing.assert_close(per_input, torch.zeros(3), rtol=0, atol=1e-6)
    assert per_output.abs().max() > 1e-3


def test_a_centralized_row_is_orthogonal_to_ones() -> None:
    """The paper's projection (section 3.3): ``P = I - e e^T`` with ``e = 1 / sqrt(M)``,
    applied to each row, so that ``e^T P g = 0`` and ``P P g = P g``."""
    grad = torch.randn(4, 6, dtype=torch.float64) + 2.0
    e = torch.full((6,), 1 / math.sqrt(6), dtype=torch.float64)
    projection = torch.eye(6, dtype=torch.float64) - torch.outer(e, e)
    param = nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    param.grad = grad.clone()
    centralize_gradients_(param)
    torch.testing.assert_close(param.grad, grad @ projection.T)
    torch.testing.assert_close(param.grad @ e, torch.zeros(4, dtype=torch.float64))
    centralize_gradients_(param)
    torch.testing.assert_close(param.grad, grad @ projection.T)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 2, 2, 2)], ids=str)
def test_zero_size_gradients(shape: tuple[int, ...]) -> None:
    param = param_with_grad(*shape)
    other = param_with_grad(3, 4)
    expected = reference(other.grad)
    centralize_gradients_([param, other])
    assert param.grad.shape == shape
    torch.testing.assert_close(other.grad.double(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_value_stays_in_its_row(bad: float) -> None:
    param = param_with_grad(3, 4)
    param.grad[1, 2] = bad
    centralize_gradients_(param)
    assert not torch.isfinite(param.grad[1]).any()
    assert torch.isfinite(param.grad[[0, 2]]).all()


@pytest.mark.parametrize("value", [0.1, 1.7])
def test_long_rows_are_centralized_within_a_few_units_in_the_last_place(value: float) -> None:
    """2**20 equal values per row: what the mean leaves behind is its rounding, which torch's
    cascaded sums keep to a few units in the last place (a plain float32 running sum would
    leave about 1e-2 of the value)."""
    param = nn.Parameter(torch.zeros(2, (1 << 20) + 3))
    param.grad = torch.full(param.shape, value)
    centralize_gradients_(param)
    ulp = torch.finfo(torch.float32).eps * value
    assert param.grad.abs().max().item() <= 4 * ulp


def test_the_hook_centralizes_before_the_step() -> None:
    params = [param_with_grad(6, 5), param_with_grad(5), param_with_grad(3, 4, 2, 2)]
    expected = [p.detach().double() - 0.1 * reference(p.grad) for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    hook = GradientCentralization()
    hook.attach(optimizer)
    optimizer.step()
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.detach().double(), want, rtol=0, atol=2e-6)
    assert repr(hook) == "GradientCentralization(conv_only=False)"


@pytest.mark.parametrize("value", [1, "yes", None], ids=["int", "str", "none"])
def test_conv_only_must_be_a_bool(value: object) -> None:
    param = param_with_grad(3, 4)
    grad = param.grad.clone()
    with pytest.raises(TypeError, match=rf"conv_only must be a bool, got conv_only={value!r}"):
        GradientCentralization(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"conv_only must be a bool, got conv_only={value!r}"):
        centralize_gradients_(param, value)  # type: ignore[arg-type]
    assert torch.equal(param.grad, grad)
