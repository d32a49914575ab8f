"""weight_norm against Chainer's convert_with_weight_normalization."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import assert_close_rel, golden_cases, load_arrays, tolerance
from normhooks import weight_norm


@pytest.mark.parametrize("case", golden_cases("weight_normalization"))
def test_conversion_gradients_and_sgd_step_match_chainer(case: dict[str, Any]) -> None:
    arrays = load_arrays(case)
    spec = dict(case["torch_layer"])
    layer = getattr(torch.nn, spec.pop("type"))(**spec)
    with torch.no_grad():
        layer.weight.copy_(arrays["W"])
        layer.bias.copy_(arrays["b"])
    weight_norm(layer)
    g = layer.parametrizations.weight.original0
    v = layer.parametrizations.weight.original1
    rel = tolerance(arrays["W"].dtype)
    assert_close_rel(g.detach(), arrays["W_g"], rel)
    assert_close_rel(v.detach(), arrays["W_v"], rel)

    y = layer(arrays["x"])
    assert_close_rel(y.detach(), arrays["y"], rel)
    y.backward(arrays["gy"])
    assert_close_rel(g.grad, arrays["gW_g"], rel)
    assert_close_rel(v.grad, arrays["gW_v"], rel)
    assert_close_rel(layer.bias.grad, arrays["gb"], rel)

    torch.optim.SGD(layer.parameters(), lr=case["lr"]).step()
    assert_close_rel(g.detach(), arrays["W_g_after"], rel)
    assert_close_rel(v.detach(), arrays["W_v_after"], rel)
    assert_close_rel(layer.weight.detach(), arrays["W_after"], rel)


def chainer_decomposition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's ``get_norm``/``normalize``, written out: norms of the rows of ``W`` as a
    matrix (axis 0 against all others), plus 1e-12."""
    norm = w.reshape(w.shape[0], -1).norm(dim=1) + 1e-12
    norm = norm.reshape(w.shape[0], *([1] * (w.ndim - 1)))
    return norm, w / norm


def test_transposed_convolution_default_is_the_seeds_axis() -> None:
    # The seed converts a Deconvolution2D's W (in x out x kh x kw, as torch) along axis 0:
    # the default dim=0 is that; dim=1 (one norm per output channel) differs on purpose.
    layer = torch.nn.ConvTranspose2d(3, 5, 3).double()
    w = layer.weight.detach().clone()
    weight_norm(layer)
    g, v = chainer_decomposition(w)
    torch.testing.assert_close(layer.parametrizations.weight.original0, g)
    torch.testing.assert_close(layer.parametrizations.weight.original1, v)
    other = weight_norm(torch.nn.ConvTranspose2d(3, 5, 3).double(), dim=1)
    assert other.parametrizations.weight.original0.shape == (1, 5, 1, 1)
