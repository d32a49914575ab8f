"""Layers whose own forward standardizes their weight: timm's StdConv2d family and the BiT
convolution of transformers.

Such a forward standardizes whatever weight a parametrization hands it, so a Scaled-WS gain
or WN's g under it is cancelled and never trains, and plain WS is done twice. timm does not
import here: the classes below reproduce its forward from the formula, under timm's module
names; transformers' class is the real one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from normhooks import (
    ScaledWeightStandardization,
    WeightNorm,
    apply_weight_norm,
    apply_weight_standardization,
    weight_norm,
    weight_standardization,
)

TIMM_MODULES = ["timm.layers.std_conv", "timm.models.layers.std_conv"]


def standardized(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each output filter to zero mean and unit (biased) variance, written out."""
    flat = weight.flatten(1)
    mean = flat.mean(1, keepdim=True)
    variance = flat.var(1, unbiased=False, keepdim=True)
    return ((flat - mean) / torch.sqrt(variance + eps)).view_as(weight)


def timm_class(name: str, module: str = "timm.layers.std_conv") -> type[nn.Conv2d]:
    """A Conv2d whose forward standardizes its weight like timm's class ``name``."""
    scaled = name.startswith("Scaled")

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        self.eps = 1e-6
        if scaled:
            self.scale = self.weight[0].numel() ** -0.5
            self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        weight = standardized(self.weight, self.eps)
        if scaled:
            weight = weight * self.gain * self.scale
        return self._conv_forward(x, weight, self.bias)

    cls = type(name, (nn.Conv2d,), {"__init__": init, "forward": forward})
    cls.__module__ = module
    return cls


TIMM_NAMES = ["StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame"]
TIMM_CASES = [
    pytest.param(name, module, id=f"{name}-{module.split('.')[1]}")
    for name in TIMM_NAMES
    for module in TIMM_MODULES
]


def bit_conv() -> nn.Conv2d:
    bit = pytest.importorskip("transformers.models.bit.modeling_bit")
    conv: nn.Conv2d = bit.WeightStandardizedConv2d(3, 4, 3, padding=1)
    return conv


def assert_unconverted(model: nn.Module) -> None:
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


# --- why: a gain or g under the layer's own standardization gets no gradient ----------------


@pytest.mark.parametrize(
    ("make", "parametrization", "which"),
    [
        (
            lambda: timm_class("ScaledStdConv2d")(3, 4, 3),
            lambda layer: ScaledWeightStandardization(layer.out_channels),
            "gain",
        ),
        (bit_conv, lambda layer: WeightNorm(), "original0"),
    ],
    ids=["scaled-ws-on-timm", "wn-on-transformers-bit"],
)
def test_a_gain_under_the_layers_own_standardization_gets_no_gradient(
    make: Any, parametrization: Any, which: str
) -> None:
    """The premise of the refusals below, registered by hand past them."""
    x = torch.randn(2, 3, 6, 6)
    grads = []
    for layer in (make(), nn.Conv2d(3, 4, 3, padding=1)):
        parametrize.register_parametrization(layer, "weight", parametrization(layer))
        holder = layer.parametrizations.weight
        gain = holder[0].gain if which == "gain" else holder.original0
        with torch.no_grad():
            gain.uniform_(0.5, 2.0)
        layer(x).square().mean().backward()
        assert gain.grad is not None
        grads.append(gain.grad.abs().max())
    under_own, plain = grads
    # Left over only where eps is not negligible next to the filters' variance.
    assert under_own < 1e-2 * plain


# --- Scaled WS and weight normalization are refused ------------------------------------------


@pytest.mark.parametrize(("name", "module"), TIMM_CASES)
@pytest.mark.parametrize(
    "convert",
    [
        lambda m: apply_weight_standardization(m, scaled=True),
        lambda m: weight_standardization(m[0], scaled=True),
    ],
    ids=["apply", "layer"],
)
def test_scaled_ws_is_refused_on_timm_standardizing_convs(
    name: str, module: str, convert: Any
) -> None:
    model = nn.Sequential(timm_class(name, module)(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    match = rf"is a {module}\.{name}, whose forward standardizes .* gain of Scaled WS"
    with pytest.raises(ValueError, match=match):
        convert(model)
    assert_unconverted(model)


@pytest.mark.parametrize(("name", "module"), TIMM_CASES)
@pytest.mark.parametrize(
    "convert",
    [apply_weight_norm, lambda m: weight_norm(m[0])],
    ids=["apply", "layer"],
)
def test_weight_norm_is_refused_on_timm_standardizing_convs(
    name: str, module: str, convert: Any
) -> None:
    model = nn.Sequential(timm_class(name, module)(3, 4, 3), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"whose forward standardizes .* it would cancel g"):
        convert(model)
    assert_unconverted(model)


def test_taking_over_torchs_weight_norm_on_one_is_refused_too() -> None:
    layer = torch.nn.utils.parametrizations.weight_norm(timm_class("StdConv2d")(3, 4, 3))
    with pytest.raises(ValueError, match=r"StdConv2d, whose forward standardizes .* cancel g"):
        apply_weight_norm(nn.Sequential(layer))
    assert type(layer.parametrizations.weight[0]).__name__ == "_WeightNorm"


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: apply_weight_standardization(m, scaled=True),
        apply_weight_norm,
    ],
    ids=["scaled-ws", "wn"],
)
def test_transformers_bit_convolution_is_refused(convert: Any) -> None:
    model = nn.Sequential(bit_conv())
    with pytest.raises(ValueError, match=r"modeling_bit\.WeightStandardizedConv2d, whose forward"):
        convert(model)
    assert_unconverted(model)


def test_a_subclass_is_caught() -> None:
    subclass = type("MyStdConv", (timm_class("StdConv2d"),), {})
    subclass.__module__ = "mymodels.layers"
    with pytest.raises(ValueError, match=r"is a timm\.layers\.std_conv\.StdConv2d, whose forward"):
        weight_norm(subclass(3, 4, 3))


def test_a_class_of_the_same_name_elsewhere_is_converted() -> None:
    lookalike = type("StdConv2d", (nn.Conv2d,), {})
    lookalike.__module__ = "mymodels.timm_like"
    layer = weight_standardization(lookalike(3, 4, 3), scaled=True)
    assert isinstance(layer.parametrizations.weight[0], ScaledWeightStandardization)


# --- plain WS: skipped in a tree with a warning, refused on the layer itself ------------------


@pytest.mark.parametrize(("name", "module"), TIMM_CASES)
def test_plain_ws_skips_them_with_a_warning(name: str, module: str) -> None:
    model = nn.Sequential(timm_class(name, module)(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 6, 6)
    expected = model[0](x).detach()
    with pytest.warns(UserWarning, match=r"skipped 0: their forward standardizes the weight"):
        apply_weight_standardization(model)
    assert not parametrize.is_parametrized(model[0])
    assert parametrize.is_parametrized(model[2], "weight")
    torch.testing.assert_close(model[0](x), expected, rtol=0, atol=0)


def test_plain_ws_on_nothing_but_them_has_nothing_to_do() -> None:
    model = nn.Sequential(timm_class("StdConv2d")(3, 4, 3), bit_conv())
    match = r"all 2 matching layers are already standardized \(2 by their own forward"
    with pytest.raises(ValueError, match=match):
        apply_weight_standardization(model)
    assert_unconverted(model)


def test_plain_ws_on_one_of_them_says_it_is_standardized() -> None:
    layer = timm_class("StdConv2dSame")(3, 4, 3)
    match = r"StdConv2dSame\.weight is already standardized by its own forward"
    with pytest.raises(ValueError, match=match):
        weight_standardization(layer)
    assert_unconverted(layer)
