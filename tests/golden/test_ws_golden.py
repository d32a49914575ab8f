"""weight_standardization against Chainer's WeightStandardization link hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import assert_close_rel, golden_cases, load_arrays, tolerance
from normhooks import weight_standardization


@pytest.mark.parametrize("case", golden_cases("weight_standardization"))
def test_output_and_gradients_match_chainer(case: dict[str, Any]) -> None:
    arrays = load_arrays(case)
    spec = dict(case["torch_layer"])
    layer_type = getattr(torch.nn, spec.pop("type"))
    dim = spec.pop("ws_dim", None)
    layer = layer_type(**spec).to(arrays["W"].dtype)
    with torch.no_grad():
        layer.weight.copy_(arrays["W"])
        if "b" in arrays:
            layer.bias.copy_(arrays["b"])
    raw = layer.weight
    weight_standardization(layer, eps=case["eps"], dim=dim)
    x = arrays["x"].clone()
    if x.is_floating_point():
        x.requires_grad_()
    y = layer(x)
    y.backward(arrays["gy"])
    rel = tolerance(arrays["W"].dtype)
    assert_close_rel(y.detach(), arrays["y"], rel)
    assert_close_rel(raw.grad, arrays["gW"], rel)
    if "gb" in arrays:
        assert_close_rel(layer.bias.grad, arrays["gb"], rel)
    if "gx" in arrays:
        assert_close_rel(x.grad, arrays["gx"], rel)
