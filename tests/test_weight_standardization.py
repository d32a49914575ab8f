"""Weight standardization: formula, every layer type, lazy, bake, caching scope, compile, errors.

What every parametrization's lifecycle keeps (state dicts, copies, baking, lazy layers,
refusals that change nothing) is tested once for all of them in test_contract.py.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from helpers import LAYERS, input_for
from normhooks import (
    ScaledWeightStandardization,
    WeightStandardization,
    apply_weight_standardization,
    remove_weight_standardization,
    standardize_weight,
    weight_standardization,
)
from normhooks import weight_norm as normhooks_weight_norm

standardization = importlib.import_module("normhooks.weight_standardization")


def reference(weight: torch.Tensor, dim: int, eps: float, groups: int = 1) -> torch.Tensor:
    """Standardizes slice by slice with explicit mean and biased variance, in float64."""
    w = weight.double()
    out = torch.empty_like(w)
    if groups == 1:
        for c in range(w.shape[dim]):
            piece = w.select(dim, c)
            out.select(dim, c).copy_(
                (piece - piece.mean()) / torch.sqrt(piece.var(unbiased=False) + eps)
            )
        return out
    # Grouped transposed convolution, dim=1: filter j of group k spans that group's inputs.
    in_per_group = w.shape[0] // groups
    for k in range(groups):
        rows = slice(k * in_per_group, (k + 1) * in_per_group)
        for j in range(w.shape[1]):
            piece = w[rows, j]
            out[rows, j] = (piece - piece.mean()) / torch.sqrt(piece.var(unbiased=False) + eps)
    return out


def output_axis(layer: nn.Module) -> int:
    return 1 if isinstance(layer, nn.modules.conv._ConvTransposeNd) else 0


@contextmanager
def count_computations() -> Iterator[list[int]]:
    """Counts standardizations actually computed (each goes through its door's
    ``standardize``)."""
    calls = [0]
    door = standardization._DOOR
    original = door.standardize

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(*args, **kwargs)

    door.standardize = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del door.standardize


# --- the formula ---------------------------------------------------------------------------


@settings(deadline=None, max_examples=80)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple),
    dim_seed=st.integers(0, 100),
    eps=st.sampled_from([1e-8, 1e-5, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_standardize_weight_matches_formula(
    shape: tuple[int, ...], dim_seed: int, eps: float, seed: int
) -> None:
    torch.manual_seed(seed)
    weight = torch.randn(shape, dtype=torch.float64)
    dim = dim_seed % len(shape) - (len(shape) if dim_seed % 2 else 0)
    torch.testing.assert_close(
        standardize_weight(weight, dim, eps), reference(weight, dim % len(shape), eps)
    )


@settings(deadline=None, max_examples=30)
@given(
    groups=st.integers(1, 3),
    in_per_group=st.integers(1, 3),
    out_per_group=st.integers(1, 3),
    kernel=st.integers(1, 3),
)
def test_grouped_transposed_filters_span_their_group(
    groups: int, in_per_group: int, out_per_group: int, kernel: int
) -> None:
    layer = nn.ConvTranspose2d(
        groups * in_per_group, groups * out_per_group, kernel, groups=groups
    ).double()
    weight = layer.weight.detach().clone()
    weight_standardization(layer)
    torch.testing.assert_close(layer.weight, reference(weight, 1, 1e-5, groups=groups))


@pytest.mark.parametrize("name", LAYERS)
def test_default_dim_is_output_channels(name: str) -> None:
    layer = LAYERS[name]().double()
    weight = layer.weight.detach().clone()
    weight_standardization(layer)
    groups = getattr(layer, "groups", 1) if output_axis(layer) == 1 else 1
    torch.testing.assert_close(
        layer.weight, reference(weight, output_axis(layer), 1e-5, groups=groups)
    )


def test_dim0_on_transposed_conv_is_per_input_channel() -> None:
    layer = nn.ConvTranspose2d(3, 4, 3).double()
    weight = layer.weight.detach().clone()
    weight_standardization(layer, dim=0)
    torch.testing.assert_close(layer.weight, reference(weight, 0, 1e-5))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("name", LAYERS)
def test_gradcheck(name: str, scaled: bool) -> None:
    layer = LAYERS[name]().double()
    weight_standardization(layer, scaled=scaled, gamma=1.7 if scaled else 1.0)
    if scaled:
        with torch.no_grad():
            layer.parametrizations.weight[0].gain.uniform_(0.5, 1.5)
    raw = layer.parametrizations.weight.original
    tensors = [raw] + ([layer.parametrizations.weight[0].gain] if scaled else [])

    parametrization = layer.parametrizations.weight[0]
    inputs = tuple(t.detach().clone().requires_grad_() for t in tensors)

    def standardize(weight: torch.Tensor, *gain: torch.Tensor) -> torch.Tensor:
        if not gain:
            return parametrization(weight)
        return torch.func.functional_call(parametrization, {"gain": gain[0]}, (weight,))

    assert torch.autograd.gradcheck(standardize, inputs)


@pytest.mark.parametrize("name", LAYERS)
def test_gradcheck_through_layer(name: str) -> None:
    layer = LAYERS[name]().double()
    weight_standardization(layer)
    inputs = input_for(layer, torch.float64)
    original = layer.parametrizations.weight.original

    def run(weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(
            layer, {"parametrizations.weight.original": weight}, inputs
        )

    assert torch.autograd.gradcheck(run, (original.detach().clone().requires_grad_(),))


def test_scaled_ws_formula() -> None:
    layer = nn.Conv2d(3, 5, 3).double()
    weight = layer.weight.detach().clone()
    weight_standardization(layer, scaled=True, gamma=2.0)
    gain = layer.parametrizations.weight[0].gain
    assert isinstance(gain, nn.Parameter)
    torch.testing.assert_close(gain, torch.ones(5, dtype=torch.float64))
    with torch.no_grad():
        gain.copy_(torch.arange(1.0, 6.0))
    expected = (
        reference(weight, 0, 1e-5)
        * (2.0 / 27**0.5)
        * torch.arange(1.0, 6.0).view(-1, 1, 1, 1).double()
    )
    torch.testing.assert_close(layer.weight, expected)


def test_scaled_ws_gain_per_output_channel_of_grouped_transposed() -> None:
    layer = nn.ConvTranspose2d(4, 6, 3, groups=2).double()
    weight_standardization(layer, scaled=True)
    gain = layer.parametrizations.weight[0].gain
    assert gain.shape == (6,)
    layer(torch.randn(1, 4, 4, 4, dtype=torch.float64)).sum().backward()
    assert gain.grad is not None
    assert torch.isfinite(gain.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_statistics_in_float32(dtype: torch.dtype) -> None:
    weight = (torch.randn(8, 300) * 50 + 1000).to(dtype)
    result = standardize_weight(weight)
    assert result.dtype == dtype
    torch.testing.assert_close(result, standardize_weight(weight.float()).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize(
    "layer",
    [nn.Linear(1, 3), nn.Conv2d(4, 4, 1, groups=4)],
    ids=["linear-one-input", "depthwise-1x1"],
)
def test_one_element_filter_gives_zeros_with_finite_grads(layer: nn.Module) -> None:
    weight_standardization(layer)
    torch.testing.assert_close(layer.weight, torch.zeros_like(layer.weight))
    x = torch.randn(2, 1) if isinstance(layer, nn.Linear) else torch.randn(2, 4, 3, 3)
    layer(x).square().sum().backward()
    assert torch.isfinite(layer.parametrizations.weight.original.grad).all()


def test_constant_filter_gives_zeros_with_finite_grads() -> None:
    layer = nn.Conv2d(2, 3, 3)
    with torch.no_grad():
        layer.weight.fill_(0.7)
    weight_standardization(layer)
    torch.testing.assert_close(layer.weight, torch.zeros_like(layer.weight))
    layer(torch.randn(2, 2, 5, 5)).square().sum().backward()
    assert torch.isfinite(layer.parametrizations.weight.original.grad).all()


# --- registration, lazy modules, removal ---------------------------------------------------


def test_raw_weight_keeps_parameter_identity() -> None:
    layer = nn.Conv2d(3, 4, 3)
    raw = layer.weight
    weight_standardization(layer)
    assert layer.parametrizations.weight.original is raw


@pytest.mark.parametrize(
    ("make", "x"),
    [
        (lambda: nn.LazyConv2d(4, 3), torch.randn(2, 3, 6, 6)),
        (lambda: nn.LazyLinear(4), torch.randn(2, 7)),
        (lambda: nn.LazyConvTranspose2d(4, 3, groups=1), torch.randn(2, 3, 4, 4)),
    ],
    ids=["lazy-conv2d", "lazy-linear", "lazy-deconv2d"],
)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_lazy_module_standardized_from_first_forward(
    make: Callable[[], nn.Module], x: torch.Tensor, scaled: bool
) -> None:
    layer = make()
    weight_standardization(layer, scaled=scaled)
    y = layer(x)
    assert parametrize.is_parametrized(layer, "weight")
    raw = layer.parametrizations.weight.original
    expected = reference(raw.detach(), output_axis(layer), 1e-5).float()
    if scaled:
        expected = (
            expected * (raw[0].numel() if output_axis(layer) == 0 else raw[:, 0].numel()) ** -0.5
        )
    torch.testing.assert_close(layer.weight, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x), y)


def test_lazy_model_via_apply() -> None:
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.GroupNorm(2, 4), nn.LazyConv2d(2, 1))
    apply_weight_standardization(model)
    with pytest.raises(ValueError, match="already standardized"):
        weight_standardization(model[0])
    model(torch.randn(1, 3, 5, 5))
    assert all(parametrize.is_parametrized(model[i], "weight") for i in (0, 2))


def test_lazy_dim_checked_at_registration() -> None:
    with pytest.raises(ValueError, match=r"dim must be in \[-4, 3\] for LazyConv2d.weight"):
        weight_standardization(nn.LazyConv2d(4, 3), dim=4)


def test_restore_gives_back_raw_weight() -> None:
    layer = nn.Linear(4, 3)
    raw_values = layer.weight.detach().clone()
    weight_standardization(layer)
    remove_weight_standardization(layer, bake=False)
    torch.testing.assert_close(layer.weight, raw_values, rtol=0, atol=0)


def test_remove_outermost_of_a_stack() -> None:
    layer = nn.Linear(4, 3)
    parametrize.register_parametrization(layer, "weight", _Double())
    weight_standardization(layer)
    remove_weight_standardization(layer, bake=False)
    assert [type(p) for p in layer.parametrizations.weight] == [_Double]


class _Double(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_apply_default_layer_types() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ConvTranspose2d(4, 4, 2),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    assert apply_weight_standardization(model) is model
    assert parametrize.is_parametrized(model[0], "weight")
    assert parametrize.is_parametrized(model[2], "weight")
    assert not parametrize.is_parametrized(model[1], "weight")
    model(torch.randn(1, 3, 6, 6))
    assert not parametrize.is_parametrized(model[4], "weight")


def test_apply_chosen_layer_types_and_skip_already_standardized() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Conv1d(1, 1, 1))
    weight_standardization(model[0], eps=1e-3)
    apply_weight_standardization(model, layer_types=nn.Linear, eps=1e-4)
    assert model[0].parametrizations.weight[0].eps == 1e-3
    assert model[2].parametrizations.weight[0].eps == 1e-4
    assert not parametrize.is_parametrized(model[3], "weight")
    apply_weight_standardization(model, layer_types=[nn.Conv1d], scaled=True)
    assert isinstance(model[3].parametrizations.weight[0], ScaledWeightStandardization)


# --- state_dict, copies, compile ----------------------------------------------------------


def test_state_dict_keys_follow_parametrize_convention() -> None:
    layer = weight_standardization(nn.Conv2d(3, 4, 3), scaled=True)
    assert set(layer.state_dict()) == {
        "bias",
        "parametrizations.weight.original",
        "parametrizations.weight.0.gain",
    }


# --- recomputed at every access; cached only inside parametrize.cached() -------------------


def test_training_forward_is_never_cached() -> None:
    layer = weight_standardization(nn.Linear(4, 3))
    with count_computations() as calls:
        layer(torch.randn(2, 4))
        layer(torch.randn(2, 4))
    assert calls[0] == 2


def test_eval_mode_second_derivatives_are_exact() -> None:
    layer = weight_standardization(nn.Linear(4, 3).double(), scaled=True)
    x = torch.randn(5, 4, dtype=torch.float64)
    raw = layer.parametrizations.weight.original

    def second_derivative() -> torch.Tensor:
        (grad,) = torch.autograd.grad(layer(x).pow(3).sum(), raw, create_graph=True)
        (hessian_vector,) = torch.autograd.grad(grad.square().sum(), raw)
        return hessian_vector

    expected = second_derivative()
    layer.eval()
    torch.testing.assert_close(second_derivative(), expected)


class _Mask(nn.Module):
    """An uncached parametrization: a fresh tensor every call."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(features))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def test_stacked_weight_follows_in_place_writes_to_the_inner_parametrization() -> None:
    layer = nn.Linear(4, 8)
    parametrize.register_parametrization(layer, "weight", _Mask(4))
    weight_standardization(layer)
    layer.eval()
    x = torch.randn(2, 4)
    mask = layer.parametrizations.weight[0].mask
    raw = layer.parametrizations.weight.original.detach()
    with torch.no_grad():
        for step in range(20):
            layer(x)
            mask.copy_(torch.rand(4) > 0.5)  # in place: the mask's new values, same buffer
            torch.testing.assert_close(layer.weight, standardize_weight(raw * mask), msg=str(step))


def test_inference_mode_result_is_not_served_to_autograd() -> None:
    layer = weight_standardization(nn.Linear(4, 3)).eval()
    with torch.inference_mode():
        layer(torch.randn(2, 4))
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.parametrizations.weight.original.grad is not None


def test_in_place_write_to_served_weight_is_not_served_again() -> None:
    layer = weight_standardization(nn.Linear(4, 3)).eval()
    with torch.no_grad():
        layer.weight.mul_(0)
        torch.testing.assert_close(
            layer.weight, standardize_weight(layer.parametrizations.weight.original.detach())
        )


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (
            lambda: nn.Linear(3, 2),
            {"name": "wieght"},
            ValueError,
            "Linear has no parameter named 'wieght'",
        ),
        (
            lambda: nn.BatchNorm2d(3),
            {"name": "running_mean"},
            TypeError,
            r"BatchNorm2d\.running_mean must be a torch\.nn\.Parameter.*got Tensor",
        ),
        (
            lambda: nn.Linear(3, 2),
            {"name": "bias"},
            ValueError,
            r"Linear\.bias has 1 dimension; weight standardization needs a tensor with at least 2",
        ),
        (
            lambda: nn.Conv2d(3, 2, 3),
            {"dim": 4},
            ValueError,
            r"dim must be in \[-4, 3\] for Conv2d\.weight with 4 dimensions, got dim=4",
        ),
        (lambda: nn.Linear(3, 2), {"eps": 0.0}, ValueError, "eps must be positive, got eps=0.0"),
        (lambda: nn.Linear(3, 2), {"eps": -1e-5}, ValueError, "eps must be positive"),
        (
            lambda: nn.Linear(3, 2),
            {"scaled": True, "gamma": 0.0},
            ValueError,
            "gamma must be positive, got gamma=0.0",
        ),
        (
            lambda: nn.Linear(3, 2, bias=False),
            {"name": "bias"},
            ValueError,
            r"Linear\.bias is None",
        ),
    ],
    ids=[
        "no-attribute",
        "not-parameter",
        "1d",
        "dim-range",
        "eps-zero",
        "eps-neg",
        "gamma",
        "none",
    ],
)
def test_registration_errors_leave_module_unchanged(
    make: Callable[[], nn.Module], kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    layer = make()
    state = copy.deepcopy(layer.state_dict())
    with pytest.raises(error, match=match):
        weight_standardization(layer, **kwargs)  # type: ignore[arg-type]
    assert not parametrize.is_parametrized(layer)
    assert set(layer.state_dict()) == set(state)


def test_removing_a_parameter_that_is_not_converted_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Linear\.weight is not standardized; nothing to remove"):
        remove_weight_standardization(nn.Linear(3, 2), "weight")


def test_baking_a_stack_is_refused() -> None:
    layer = nn.Linear(4, 3)
    parametrize.register_parametrization(layer, "weight", _Double())
    weight_standardization(layer)
    with pytest.raises(ValueError, match="other parametrizations besides weight standardization"):
        remove_weight_standardization(layer, bake=True)


def test_apply_errors() -> None:
    with pytest.raises(TypeError, match=r"layer_types must be nn\.Module subclasses, got 3"):
        apply_weight_standardization(nn.Linear(2, 2), layer_types=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="eps must be positive"):
        apply_weight_standardization(nn.Linear(2, 2), eps=0)


def test_parametrization_constructor_errors() -> None:
    with pytest.raises(ValueError, match="eps must be positive"):
        WeightStandardization(eps=0.0)
    with pytest.raises(TypeError, match=r"dim must be an int, got dim=0\.5"):
        WeightStandardization(dim=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups must be positive, got groups=0"):
        WeightStandardization(groups=0)
    with pytest.raises(TypeError, match="groups must be an int, got groups='2'"):
        WeightStandardization(groups="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_channels must be positive, got num_channels=0"):
        ScaledWeightStandardization(0)


def test_parametrization_dim_checked_when_registered_directly() -> None:
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\] for a weight of shape"):
        parametrize.register_parametrization(
            nn.Linear(3, 2), "weight", WeightStandardization(dim=5)
        )


def test_remove_checks_name_type() -> None:
    with pytest.raises(TypeError, match="name must be a str, got name=3"):
        remove_weight_standardization(nn.Linear(3, 2), 3)  # type: ignore[arg-type]


def test_bake_does_not_alias_a_weight_served_earlier() -> None:
    layer = weight_standardization(nn.Linear(4, 3)).eval()
    with torch.no_grad():
        served = layer.weight
        snapshot = served.clone()
    remove_weight_standardization(layer)
    with torch.no_grad():
        layer.weight.add_(1.0)
    torch.testing.assert_close(served, snapshot, rtol=0, atol=0)


def test_module_argument_checked() -> None:
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module, got str"):
        weight_standardization("conv")  # type: ignore[arg-type]


def test_gamma_without_scaled_is_refused() -> None:
    layer = nn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"gamma=2\.0 scales only Scaled WS; pass scaled=True"):
        weight_standardization(layer, gamma=2.0)
    assert not parametrize.is_parametrized(layer)
    with pytest.raises(ValueError, match="pass scaled=True"):
        apply_weight_standardization(nn.Sequential(layer), gamma=2.0)


def test_apply_matching_no_layer_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"nothing to standardize in Sequential: it has no layer"):
        apply_weight_standardization(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    model = apply_weight_standardization(nn.Sequential(nn.Conv2d(3, 2, 1)))
    with pytest.raises(ValueError, match="all 1 matching layers are already standardized"):
        apply_weight_standardization(model)


def test_scaled_ws_channel_count_checked_at_registration() -> None:
    layer = nn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"num_channels=5, but the weight of shape \[4, 3, 3, 3\]"):
        parametrize.register_parametrization(layer, "weight", ScaledWeightStandardization(5))
    assert not parametrize.is_parametrized(layer)


@pytest.mark.parametrize(
    "make",
    [lambda: nn.ConvTranspose2d(3, 4, 3), lambda: nn.ConvTranspose2d(4, 6, 3, groups=2)],
    ids=["deconv", "deconv-grouped"],
)
def test_baked_transposed_weight_is_contiguous(make: Callable[[], nn.Module]) -> None:
    layer = weight_standardization(make())
    weight = layer.parametrizations.weight.original
    x = torch.randn(1, layer.in_channels, 4, 4)
    before = layer(x)
    remove_weight_standardization(layer)
    assert layer.weight is weight
    assert layer.weight.is_contiguous()
    nn.utils.parameters_to_vector(layer.parameters())
    torch.testing.assert_close(layer(x), before)


def test_dim_of_the_wrong_type_is_refused_at_entry_on_a_lazy_layer_of_unknown_rank() -> None:
    """The rank of a LazyBatchNorm1d's weight is only known at its first forward; the type of
    dim is known now."""
    with pytest.raises(TypeError, match=r"dim must be an int, got dim='0'"):
        weight_standardization(nn.LazyBatchNorm1d(), dim="0")  # type: ignore[arg-type]


def test_remove_every_standardization_in_a_tree() -> None:
    model = apply_weight_standardization(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyConv2d(2, 3)), scaled=True
    )
    remove_weight_standardization(model, bake=False)
    assert not any(parametrize.is_parametrized(m) for m in model)
    model(torch.randn(1, 3, 7, 7))
    assert not parametrize.is_parametrized(model[1])
    with pytest.raises(ValueError, match="Sequential has no weight standardization to remove"):
        remove_weight_standardization(model)


def test_weight_standardization_on_a_model_points_to_apply() -> None:
    with pytest.raises(ValueError, match="use apply_weight_standardization"):
        weight_standardization(nn.Sequential(nn.Conv2d(3, 4, 3)))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2)
    )


class _SmoothBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SiLU, not ReLU: a ReLU gradient jumps where a pre-activation within float32 noise of
        # 0 changes sign, which any two float32 schedules (eager channels_last as much as
        # inductor's) decide differently now and then, so no tight tolerance could hold.
        y = nn.functional.silu(self.norm1(self.conv1(x)))
        return nn.functional.silu(x + self.norm2(self.conv2(y)))


@pytest.mark.inductor
def test_inductor_gradients_of_a_multi_block_model_match_float64_eager() -> None:
    """Inductor's layout optimization runs these convolutions channels_last; the standardized
    weights and every gradient must still match float64 eager to float32 rounding."""
    torch._dynamo.reset()
    width = 16
    model = apply_weight_standardization(
        nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.GroupNorm(4, width),
            nn.SiLU(),
            _SmoothBlock(width),
            _SmoothBlock(width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )
    )
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))

    def gradients(dtype: torch.dtype, compiled: bool) -> list[torch.Tensor]:
        copy_ = copy.deepcopy(model).to(dtype)
        run = torch.compile(copy_, backend="inductor") if compiled else copy_
        nn.functional.cross_entropy(run(x.to(dtype)), y).backward()
        return [p.grad.double() for p in copy_.parameters()]

    truth = gradients(torch.float64, compiled=False)
    compiled = gradients(torch.float32, compiled=True)
    assert len(compiled) == len(truth) == 17
    for got, want in zip(compiled, truth, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-4


# --- found in review ------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [False, True], ids=["ws", "scaled"])
def test_baking_tied_weights_is_refused_not_applied_twice(scaled: bool) -> None:
    a, b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
    b.weight = a.weight
    model = apply_weight_standardization(nn.Sequential(a, b), scaled=scaled)
    x = torch.randn(1, 3, 5, 5)
    before = [a(x), b(x)]
    with pytest.raises(ValueError, match=r"0.weight and 1.weight standardize the same raw"):
        remove_weight_standardization(model)
    torch.testing.assert_close(a(x), before[0], rtol=0, atol=0)
    torch.testing.assert_close(b(x), before[1], rtol=0, atol=0)
    remove_weight_standardization(model, bake=False)
    assert a.weight is b.weight


def test_groups_need_the_output_axis_of_a_transposed_layout() -> None:
    with pytest.raises(ValueError, match=r"groups=2 splits axis 0.*got dim=0"):
        standardize_weight(torch.randn(4, 3, 3, 3), 0, groups=2)
    with pytest.raises(ValueError, match=r"axis 0 divisible by groups"):
        standardize_weight(torch.randn(3, 4, 3, 3), 1, groups=2)
    layer = nn.Conv2d(4, 4, 3)
    with pytest.raises(ValueError, match="groups=2 splits axis 0"):
        parametrize.register_parametrization(layer, "weight", WeightStandardization(groups=2))
    assert not parametrize.is_parametrized(layer)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("make", [lambda: nn.Conv2d(3, 0, 3), lambda: nn.Linear(3, 0)])
def test_a_layer_without_output_channels(make: Callable[[], nn.Module]) -> None:
    layer = weight_standardization(make())
    assert layer.weight.shape == layer.parametrizations.weight.original.shape


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_apply_refuses_torch_legacy_weight_norm_instead_of_skipping_it() -> None:
    legacy = torch.nn.utils.weight_norm(nn.Conv2d(3, 4, 3))
    model = nn.Sequential(nn.Conv2d(3, 3, 1), legacy)
    with pytest.raises(ValueError, match="carries torch's legacy weight norm"):
        apply_weight_standardization(model)
    assert not parametrize.is_parametrized(model[0])


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_a_layer_with_torchs_legacy_weight_norm_is_refused_with_the_same_message() -> None:
    layer = torch.nn.utils.weight_norm(nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match=r"Conv2d\.weight carries torch's legacy weight norm"):
        weight_standardization(layer)
    assert not parametrize.is_parametrized(layer)


def test_a_lazy_bias_is_refused_at_entry() -> None:
    with pytest.raises(ValueError, match=r"Linear\.bias has 1 dimension"):
        weight_standardization(nn.LazyLinear(3), "bias")


# --- a weight norm underneath: standardization would cancel its g ---------------------------


def _torch_wn(layer: nn.Module, dim: int | None = 0) -> nn.Module:
    return torch.nn.utils.parametrizations.weight_norm(layer, dim=dim)


@pytest.mark.parametrize(
    "make",
    [
        lambda: normhooks_weight_norm(nn.Conv2d(3, 4, 3)),
        lambda: normhooks_weight_norm(nn.Conv2d(3, 4, 3), dim=None),
        lambda: normhooks_weight_norm(nn.ConvTranspose2d(4, 6, 2, groups=2), dim=1),
        lambda: _torch_wn(nn.Conv2d(3, 4, 3)),
        lambda: _torch_wn(nn.Conv2d(3, 4, 3), dim=None),
        lambda: normhooks_weight_norm(nn.LazyConv2d(4, 3)),
    ],
    ids=["normhooks", "normhooks-whole", "grouped-deconv-dim1", "torch", "torch-whole", "pending"],
)
@pytest.mark.parametrize("scaled", [False, True], ids=["ws", "scaled"])
def test_standardizing_a_weight_norm_that_it_would_cancel_is_refused(
    make: Callable[[], nn.Module], scaled: bool
) -> None:
    layer = make()
    chain = [type(p) for p in standardization._parametrize.parametrizations_of(layer, "weight")]
    with pytest.raises(ValueError, match=r"is weight-normalized.* would cancel g, which would"):
        weight_standardization(layer, scaled=scaled)
    assert [
        type(p) for p in standardization._parametrize.parametrizations_of(layer, "weight")
    ] == chain


def test_a_weight_standardized_over_a_weight_norm_barely_depends_on_g() -> None:
    """The premise of the refusal, registered by hand past it: doubling g moves the weight
    by about eps / var(W), so g gets a gradient of about zero."""
    layer = normhooks_weight_norm(nn.Conv2d(3, 4, 3))
    parametrize.register_parametrization(layer, "weight", WeightStandardization())
    before = layer.weight.detach()
    with torch.no_grad():
        layer.parametrizations.weight.original0.mul_(2.0)
    moved = (layer.weight.detach() - before).abs().max()
    assert moved < 1e-2 * before.abs().max()


def test_a_weight_norm_along_another_axis_stacks() -> None:
    """wav2vec 2.0's positional convolution: weight norm along the kernel axis, dim=2."""
    layer = _torch_wn(nn.Conv1d(4, 4, 5, padding=2), dim=2)
    weight_standardization(layer)
    w = layer.weight.flatten(1)
    torch.testing.assert_close(w.mean(1), torch.zeros(4), rtol=0, atol=1e-6)
