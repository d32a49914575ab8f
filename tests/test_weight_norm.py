"""Weight normalization: conversion, the seed's self-test, RNNs, interop, DDI, errors."""

from __future__ import annotations

import copy
import importlib
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from helpers import LAYERS, assert_compiled_training_matches_eager, input_for
from normhooks import (
    WeightNorm,
    convert_with_weight_normalization,
    data_dependent_init,
    remove_weight_norm,
    weight_norm,
    weight_standardization,
)

normalization = importlib.import_module("normhooks.weight_norm")


def effective(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """g * v / ||v|| written out from the stored originals (norms over all axes but dim)."""
    originals = module.parametrizations[name]
    g, v = originals.original0, originals.original1
    dim = originals[0].dim % v.ndim
    dims = [d for d in range(v.ndim) if d != dim]
    return g * v / (torch.linalg.vector_norm(v, dim=dims, keepdim=True) + originals[0].eps)


def wn_names(module: nn.Module) -> list[str]:
    return [
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, sub in module.named_modules()
        for name in (sub.parametrizations.keys() if hasattr(sub, "parametrizations") else [])
    ]


# --- conversion ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYERS)
def test_conversion_keeps_output_and_gives_unit_rows(name: str) -> None:
    layer = LAYERS[name]().double()
    inputs = input_for(layer, torch.float64)
    before = layer(*inputs)
    weight_norm(layer)
    torch.testing.assert_close(layer(*inputs), before)
    v = layer.parametrizations.weight.original1
    dim = 1 if isinstance(layer, nn.modules.conv._ConvTransposeNd) else 0
    dims = [d for d in range(v.ndim) if d != dim]
    norms = torch.linalg.vector_norm(v, dim=dims)
    torch.testing.assert_close(norms, torch.ones(v.shape[dim], dtype=v.dtype))
    g = layer.parametrizations.weight.original0
    assert g.shape == tuple(v.shape[d] if d == dim else 1 for d in range(v.ndim))


def test_name_none_converts_every_matrix_in_the_tree() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(), nn.Linear(4, 2)),
    )
    weight_norm(model)
    assert wn_names(model) == ["0.weight", "2.1.weight"]
    assert not parametrize.is_parametrized(model[1])


def test_lstm_every_layer_and_direction() -> None:
    lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    weight_norm(lstm)
    expected = {
        f"weight_{kind}_l{layer}{suffix}"
        for kind in ("ih", "hh")
        for layer in (0, 1)
        for suffix in ("", "_reverse")
    }
    assert set(lstm.parametrizations.keys()) == expected
    assert all(b.ndim == 1 for n, b in lstm.named_parameters() if "bias" in n)


def test_multihead_attention_projections() -> None:
    attention = nn.MultiheadAttention(8, 2)
    x = torch.randn(5, 3, 8)
    before, _ = attention(x, x, x)
    weight_norm(attention)
    assert set(wn_names(attention)) == {"in_proj_weight", "out_proj.weight"}
    after, _ = attention(x, x, x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_explicit_name_converts_only_that_parameter() -> None:
    attention = nn.MultiheadAttention(8, 2)
    weight_norm(attention, "in_proj_weight")
    assert wn_names(attention) == ["in_proj_weight"]


def test_tied_module_is_unaffected_by_converting_one_owner() -> None:
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    tokens = torch.tensor([1, 5, 7])
    before = embedding(tokens).detach().clone()
    weight_norm(head, "weight")
    torch.testing.assert_close(embedding(tokens), before, rtol=0, atol=0)
    torch.testing.assert_close(head.weight, embedding.weight)


def test_name_none_refuses_tied_weights() -> None:
    model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10)})
    model["head"].weight = model["embed"].weight
    with pytest.raises(ValueError, match=r"embed\.weight and head\.weight are the same Parameter"):
        weight_norm(model)
    assert wn_names(model) == []


def test_channels_last_conv_backward() -> None:
    reference = weight_norm(nn.Conv2d(3, 4, 3).double())
    layer = copy.deepcopy(reference).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    layer(x.to(memory_format=torch.channels_last)).square().sum().backward()
    reference(x).square().sum().backward()
    for a, b in zip(layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_ddi_on_unbatched_conv_input() -> None:
    model = weight_norm(nn.Sequential(nn.Conv1d(2, 3, 3)))
    x = torch.randn(2, 50)
    data_dependent_init(model, x)
    y = model(x)
    torch.testing.assert_close(y.std(1, unbiased=False), torch.ones(3), atol=1e-4, rtol=0)


def test_convert_with_weight_normalization_builds_and_converts() -> None:
    conv = convert_with_weight_normalization(nn.Conv2d, 2, 4, kernel_size=3, padding=1)
    assert isinstance(conv, nn.Conv2d)
    assert wn_names(conv) == ["weight"]


# --- the seed's own self-test, ported ------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "x"),
    [
        (lambda: convert_with_weight_normalization(nn.Linear, 3, 5), torch.rand(10, 3)),
        (
            lambda: convert_with_weight_normalization(nn.Conv2d, 2, 4, kernel_size=3, padding=1),
            torch.rand(10, 2, 20, 20),
        ),
        (lambda: convert_with_weight_normalization(nn.LSTM, 3, 5), torch.rand(10, 3)),
    ],
    ids=["linear", "conv2d", "lstm"],
)
def test_seed_self_test(make: Callable[[], nn.Module], x: torch.Tensor) -> None:
    module = make()
    names = list(module.parametrizations.keys())
    for name in names:
        w = getattr(module, name)
        g = module.parametrizations[name].original0
        v = module.parametrizations[name].original1
        assert w.grad_fn is not None
        assert g.grad_fn is None
        assert v.grad_fn is None
        torch.testing.assert_close(w, effective(module, name), rtol=1e-5, atol=1e-7)
    before = {
        name: [
            t.detach().clone()
            for t in (
                getattr(module, name),
                module.parametrizations[name].original0,
                module.parametrizations[name].original1,
            )
        ]
        for name in names
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    output = module(x)
    output = output[0] if isinstance(output, tuple) else output
    output.square().sum().backward()
    optimizer.step()
    for name in names:
        after = (
            getattr(module, name),
            module.parametrizations[name].original0,
            module.parametrizations[name].original1,
        )
        for old, new in zip(before[name], after, strict=True):
            assert (old != new.detach()).all()
        torch.testing.assert_close(
            getattr(module, name), effective(module, name), rtol=1e-5, atol=1e-7
        )


# --- gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYERS)
def test_gradcheck(name: str) -> None:
    layer = weight_norm(LAYERS[name]().double())
    inputs = input_for(layer, torch.float64)
    keys = ["parametrizations.weight.original0", "parametrizations.weight.original1"]
    values = tuple(layer.get_parameter(k).detach().clone().requires_grad_() for k in keys)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip(keys, tensors, strict=True)), inputs)

    assert torch.autograd.gradcheck(run, values)


@pytest.mark.parametrize("rnn_type", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_gradcheck_bidirectional_two_layer_rnn(rnn_type: type[nn.RNNBase]) -> None:
    rnn = weight_norm(rnn_type(2, 3, num_layers=2, bidirectional=True).double())
    x = torch.randn(4, 2, 2, dtype=torch.float64)
    keys = [f"parametrizations.{name}.original{i}" for name in rnn.parametrizations for i in (0, 1)]
    values = tuple(rnn.get_parameter(k).detach().clone().requires_grad_() for k in keys)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        output, _ = torch.func.functional_call(rnn, dict(zip(keys, tensors, strict=True)), (x,))
        return output

    assert torch.autograd.gradcheck(run, values)


@pytest.mark.parametrize("eps", [0.0, 1e-12, 0.1], ids=["eps0", "eps-default", "eps-large"])
@pytest.mark.parametrize("dim", [0, 1, -1], ids=["dim0", "dim1", "dim-last"])
def test_closed_form_gradients_match_autograd_of_the_formula(dim: int, eps: float) -> None:
    g = torch.rand(4, 1, 1, dtype=torch.float64) + 0.5
    g = g.movedim(0, dim)
    v = torch.randn(4, 3, 2, dtype=torch.float64).movedim(0, dim).contiguous()
    v.select(dim, 1).zero_()  # a zero row
    grad_w = torch.randn_like(v)
    results = []
    for fn in (normalization._WeightNormFunction.apply, normalization._weight_norm):
        g_, v_ = g.clone().requires_grad_(), v.clone().requires_grad_()
        fn(g_, v_, dim % 3, eps).backward(grad_w)
        results.append((g_.grad, v_.grad))
    for closed_form, autograd in zip(*results, strict=True):
        assert torch.isfinite(closed_form).all()
        torch.testing.assert_close(closed_form, autograd)


def test_double_backward() -> None:
    layer = weight_norm(nn.Linear(4, 3).double())
    keys = ["parametrizations.weight.original0", "parametrizations.weight.original1"]
    values = tuple(layer.get_parameter(k).detach().clone().requires_grad_() for k in keys)
    x = torch.randn(2, 4, dtype=torch.float64)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip(keys, tensors, strict=True)), (x,))

    assert torch.autograd.gradgradcheck(run, values)


# --- RNNs keep working ---------------------------------------------------------------------


@pytest.mark.parametrize("rnn_type", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
def test_rnn_matches_plain_rnn_with_same_effective_weights(rnn_type: type[nn.RNNBase]) -> None:
    rnn = weight_norm(rnn_type(3, 4, num_layers=2, bidirectional=True))
    with torch.no_grad():
        for name in rnn.parametrizations:
            rnn.parametrizations[name].original0.uniform_(0.5, 2.0)
    plain = rnn_type(3, 4, num_layers=2, bidirectional=True)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(getattr(rnn, name))
    x = torch.randn(6, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            torch.testing.assert_close(rnn(x)[0], plain(x)[0])
        rnn.flatten_parameters()
        torch.testing.assert_close(rnn(x)[0], plain(x)[0])


def test_rnn_sees_updates_after_optimizer_step() -> None:
    rnn = weight_norm(nn.LSTM(3, 4))
    optimizer = torch.optim.SGD(rnn.parameters(), lr=0.5)
    x = torch.randn(5, 2, 3)
    before = rnn(x)[0].detach()
    rnn(x)[0].square().sum().backward()
    optimizer.step()
    plain = nn.LSTM(3, 4)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(getattr(rnn, name))
    after = rnn(x)[0]
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, plain(x)[0])


# --- zero rows, dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-12, 0.0], ids=["default-eps", "eps0"])
def test_zero_row_gives_zero_row_and_finite_grads(eps: float) -> None:
    embedding = nn.Embedding(5, 3, padding_idx=0)
    weight_norm(embedding, eps=eps)
    assert torch.equal(embedding.weight[0], torch.zeros(3))
    assert torch.isfinite(embedding.weight).all()
    embedding(torch.tensor([0, 1, 2, 0])).sum().backward()
    for param in embedding.parameters():
        assert torch.isfinite(param.grad).all()


def test_half_precision_norms_in_float32() -> None:
    layer = nn.Linear(300, 4).to(torch.bfloat16)
    weight_norm(layer)
    expected = effective(layer)
    assert layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer.weight.float(), expected.float(), rtol=1e-2, atol=1e-3)


# --- removal -------------------------------------------------------------------------------


def test_remove_keeps_output_and_identity() -> None:
    layer = weight_norm(nn.Conv2d(3, 4, 3))
    with torch.no_grad():
        layer.parametrizations.weight.original0.mul_(1.5)
    v = layer.parametrizations.weight.original1
    x = torch.randn(1, 3, 5, 5)
    expected = layer(x)
    remove_weight_norm(layer)
    assert type(layer) is nn.Conv2d
    assert layer.weight is v
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
    torch.testing.assert_close(layer(x), expected)


def test_remove_everything_in_a_tree() -> None:
    model = weight_norm(nn.Sequential(nn.Linear(3, 4), nn.LSTM(4, 2)))
    remove_weight_norm(model)
    assert wn_names(model) == []
    model[1](torch.randn(2, 1, 4))


def test_remove_one_name() -> None:
    lstm = weight_norm(nn.LSTM(3, 2))
    remove_weight_norm(lstm, "weight_hh_l0")
    assert list(lstm.parametrizations.keys()) == ["weight_ih_l0"]


# --- interop, state dicts, copies ----------------------------------------------------------


def test_torch_weight_norm_state_dict_loads_into_normhooks() -> None:
    source = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3))
    with torch.no_grad():
        source.parametrizations.weight.original0.mul_(2.0)
    target = weight_norm(nn.Conv2d(3, 4, 3))
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(target(x), source(x))


def test_normhooks_state_dict_loads_into_torch_weight_norm() -> None:
    source = weight_norm(nn.Linear(4, 3))
    with torch.no_grad():
        source.parametrizations.weight.original0.mul_(3.0)
    target = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 4)
    torch.testing.assert_close(target(x), source(x))


def test_legacy_weight_norm_checkpoint_loads() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        legacy = torch.nn.utils.weight_norm(nn.Linear(4, 3))
    state = legacy.state_dict()
    assert {"weight_g", "weight_v"} <= set(state)
    target = weight_norm(nn.Linear(4, 3))
    target.load_state_dict(state)
    x = torch.randn(2, 4)
    torch.testing.assert_close(target(x), legacy(x))


def test_state_dict_round_trip_through_torch_save() -> None:
    source = weight_norm(nn.LSTM(3, 4, num_layers=2))
    target = weight_norm(nn.LSTM(3, 4, num_layers=2))
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer))
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(target(x)[0], source(x)[0])


def test_deepcopy() -> None:
    model = weight_norm(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))).eval()
    x = torch.randn(2, 3)
    with torch.no_grad():
        model(x)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].parametrizations.weight.original0.mul_(2.0)
        assert not torch.allclose(clone(x), model(x))
        torch.testing.assert_close(clone[0].weight, effective(clone[0]))


def test_parametrize_cached_computes_once_per_scope() -> None:
    model = weight_norm(nn.Linear(4, 3)).eval()
    calls = [0]
    original = normalization.WeightNorm.forward

    def counting(self: WeightNorm, *tensors: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return original(self, *tensors)

    normalization.WeightNorm.forward = counting  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
        assert calls[0] == 2
        with torch.no_grad(), parametrize.cached():
            model(torch.randn(2, 4))
            model(torch.randn(2, 4))
        assert calls[0] == 3
    finally:
        normalization.WeightNorm.forward = original  # type: ignore[method-assign]


def test_compiled_training_step_matches_eager() -> None:
    model = weight_norm(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    )
    assert_compiled_training_matches_eager(
        model, torch.randn(2, 3, 6, 6), lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    )


# --- lazy modules --------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, "weight"], ids=["all", "weight"])
def test_lazy_module_converted_at_first_forward(name: str | None) -> None:
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    for layer in (model[0], model[3]):
        weight_norm(layer, name)
    x = torch.randn(2, 3, 5, 5)
    y = model(x)
    assert wn_names(model) == ["0.weight", "3.weight"]
    torch.testing.assert_close(model(x), y)
    v = model[0].parametrizations.weight.original1
    torch.testing.assert_close(v.flatten(1).norm(dim=1), torch.ones(4))


def test_lazy_pending_conversion_counts_as_converted() -> None:
    layer = weight_norm(nn.LazyLinear(3), "weight")
    with pytest.raises(ValueError, match=r"LazyLinear\.weight is already weight-normalized"):
        weight_norm(layer, "weight")
    remove_weight_norm(layer, "weight")
    layer(torch.randn(2, 4))
    assert not parametrize.is_parametrized(layer)


# --- data-dependent initialization ---------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 6, 2, stride=2),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 14 * 14, 5),
    )


def layer_outputs(model: nn.Module, x: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor]]:
    outputs: list[tuple[nn.Module, torch.Tensor]] = []
    handles = [
        m.register_forward_hook(lambda m, a, y: outputs.append((m, y)))
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return outputs


@pytest.mark.parametrize(
    ("make", "x"),
    [(mlp, torch.randn(512, 6)), (cnn, torch.randn(64, 3, 8, 8))],
    ids=["mlp", "cnn"],
)
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_ddi_postcondition(make: Callable[[], nn.Module], x: torch.Tensor, scale: float) -> None:
    model = weight_norm(make())
    data_dependent_init(model, x, scale=scale)
    outputs = layer_outputs(model, x)
    assert len(outputs) == len(
        [m for m in model.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
    )
    for layer, y in outputs:
        axis = -1 if isinstance(layer, nn.Linear) else 1
        rows = y.movedim(axis, -1).reshape(-1, y.shape[axis]).double()
        if layer.bias is not None:  # without a bias only g is set: the std, not the mean
            zeros = torch.zeros(rows.shape[1], dtype=torch.float64)
            torch.testing.assert_close(rows.mean(0), zeros, atol=1e-4, rtol=0)
        torch.testing.assert_close(
            rows.std(0, unbiased=False),
            torch.full((rows.shape[1],), scale, dtype=torch.float64),
            atol=1e-4,
            rtol=0,
        )


def test_ddi_sets_g_and_bias_from_first_layer_moments() -> None:
    model = weight_norm(nn.Sequential(nn.Linear(4, 3)))
    x = torch.randn(100, 4)
    layer = model[0]
    v = layer.parametrizations.weight.original1.detach()
    t = x @ (v / v.norm(dim=1, keepdim=True)).T
    data_dependent_init(model, x, scale=2.0)
    std = t.std(0, unbiased=False)
    torch.testing.assert_close(layer.parametrizations.weight.original0.view(-1), 2.0 / std)
    torch.testing.assert_close(layer.bias, -t.mean(0) * 2.0 / std)


def test_ddi_restores_modes_and_leaves_lstm_g() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)
            self.dropout = nn.Dropout(0.5)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.dropout(self.lstm(x)[0][:, -1]))

    model = weight_norm(Model())
    model.dropout.eval()
    lstm_g = model.lstm.parametrizations.weight_ih_l0.original0.detach().clone()
    data_dependent_init(model, torch.randn(32, 5, 3))
    assert model.training
    assert not model.dropout.training
    assert model.lstm.training
    torch.testing.assert_close(model.lstm.parametrizations.weight_ih_l0.original0, lstm_g)


def test_ddi_tuple_and_mapping_batches() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x + y)

    model = weight_norm(TwoInputs())
    data_dependent_init(model, (torch.randn(8, 3), torch.randn(8, 3)))
    data_dependent_init(model, {"x": torch.randn(8, 3), "y": torch.randn(8, 3)})


def test_ddi_warns_about_unreached_layers() -> None:
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = weight_norm(Partial())
    g = model.unused.parametrizations.weight.original0.detach().clone()
    with pytest.warns(UserWarning, match="the forward never reached unused"):
        data_dependent_init(model, torch.randn(8, 3))
    torch.testing.assert_close(model.unused.parametrizations.weight.original0, g)


def test_ddi_failed_forward_leaves_model_unchanged() -> None:
    model = weight_norm(mlp())
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        data_dependent_init(model, torch.randn(4, 7))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    assert model.training


def test_ddi_without_wn_layer() -> None:
    with pytest.raises(ValueError, match="Sequential has no weight-normalized Linear, Conv or"):
        data_dependent_init(nn.Sequential(nn.Linear(2, 2)), torch.randn(3, 2))
    with pytest.raises(ValueError, match="LSTM has no weight-normalized Linear"):
        data_dependent_init(weight_norm(nn.LSTM(2, 2)), torch.randn(3, 1, 2))


def test_ddi_refuses_lazy_layers_not_yet_materialized() -> None:
    model = nn.Sequential(nn.LazyLinear(3))
    weight_norm(model[0])
    with pytest.raises(ValueError, match=r"0 \(LazyLinear\) is a lazy module .* run one forward"):
        data_dependent_init(model, torch.randn(4, 2))
    model(torch.randn(4, 2))
    data_dependent_init(model, torch.randn(4, 2))


def test_ddi_errors() -> None:
    with pytest.raises(ValueError, match="scale must be positive, got scale=0"):
        data_dependent_init(weight_norm(mlp()), torch.randn(4, 6), scale=0)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        data_dependent_init("model", torch.randn(4, 6))  # type: ignore[type-var]
    grouped = weight_norm(nn.Sequential(nn.ConvTranspose2d(4, 4, 2, groups=2)))
    with pytest.raises(ValueError, match=r"cannot initialize 0 \(ConvTranspose2d\): with groups=2"):
        data_dependent_init(grouped, torch.randn(2, 4, 3, 3))
    sideways = weight_norm(nn.Sequential(nn.Linear(3, 2)), dim=1)
    with pytest.raises(ValueError, match=r"0 \(Linear\) is weight-normalized along dim=1"):
        data_dependent_init(sideways, torch.randn(2, 3))
    stacked = weight_norm(nn.Sequential(nn.Linear(3, 2)))
    weight_standardization(stacked[0])
    with pytest.raises(ValueError, match=r"needs weight normalization alone on 0 \(Linear\)"):
        data_dependent_init(stacked, torch.randn(2, 3))


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
            lambda: nn.BatchNorm1d(3),
            {"name": "running_mean"},
            TypeError,
            r"BatchNorm1d\.running_mean must be a torch\.nn\.Parameter",
        ),
        (
            lambda: nn.Linear(3, 2),
            {"name": "bias"},
            ValueError,
            r"Linear\.bias has 1 dimension; weight normalization applies to parameters with at",
        ),
        (
            lambda: nn.Linear(3, 2),
            {"name": "weight", "dim": 2},
            ValueError,
            r"dim must be in \[-2, 1\] for Linear\.weight with 2 dimensions, got dim=2",
        ),
        (
            lambda: nn.Sequential(nn.Linear(3, 2), nn.Conv2d(1, 1, 1)),
            {"dim": 3},
            ValueError,
            r"dim must be in \[-2, 1\] for Linear\.weight",
        ),
        (lambda: nn.Linear(3, 2), {"eps": -1e-12}, ValueError, "eps must be non-negative"),
        (
            lambda: nn.LayerNorm(3),
            {},
            ValueError,
            "nothing to convert in LayerNorm: it has no parameter with 2 or more dimensions",
        ),
    ],
    ids=["no-attribute", "not-parameter", "1d", "dim", "dim-tree", "eps", "nothing"],
)
def test_conversion_errors_leave_module_unchanged(
    make: Callable[[], nn.Module], kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    module = make()
    keys = set(module.state_dict())
    with pytest.raises(error, match=match):
        weight_norm(module, **kwargs)  # type: ignore[arg-type]
    assert set(module.state_dict()) == keys
    assert wn_names(module) == []


def test_non_floating_parameter() -> None:
    layer = nn.Linear(3, 2)
    layer.weight = nn.Parameter(torch.ones(2, 3, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match=r"Linear\.weight must be a real floating-point.*int32"):
        weight_norm(layer, "weight")


def test_nothing_to_convert_says_why() -> None:
    layer = weight_standardization(nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match="0 are already weight-normalized and 1 have another"):
        weight_norm(layer)


def test_weight_norm_dim_checked_when_registered_directly() -> None:
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\] for a weight of shape"):
        parametrize.register_parametrization(nn.Linear(3, 2), "weight", WeightNorm(dim=5))


def test_remove_one_name_of_a_pending_lazy_conversion() -> None:
    layer = weight_norm(nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"LazyLinear\.weight is waiting to be converted"):
        remove_weight_norm(layer, "weight")
    remove_weight_norm(layer)
    layer(torch.randn(2, 4))
    assert wn_names(layer) == []


def test_converting_twice() -> None:
    layer = weight_norm(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"Linear\.weight is already weight-normalized"):
        weight_norm(layer, "weight")
    with pytest.raises(ValueError, match="1 are already weight-normalized and 0 have another"):
        weight_norm(layer)


def test_remove_errors() -> None:
    with pytest.raises(ValueError, match=r"Linear\.weight is not weight-normalized"):
        remove_weight_norm(nn.Linear(3, 2), "weight")
    with pytest.raises(ValueError, match="Linear has no weight normalization to remove"):
        remove_weight_norm(nn.Linear(3, 2))


def test_parametrization_constructor_errors() -> None:
    with pytest.raises(ValueError, match="eps must be non-negative"):
        WeightNorm(eps=-1.0)
    with pytest.raises(TypeError, match="dim must be an int"):
        WeightNorm(dim="0")  # type: ignore[arg-type]


def test_convert_with_weight_normalization_errors() -> None:
    with pytest.raises(TypeError, match="module_cls must be a module class"):
        convert_with_weight_normalization(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"module_cls must build a torch\.nn\.Module, got list"):
        convert_with_weight_normalization(list)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    smallest=st.floats(1e-30, 1e6),
    factors=st.lists(st.floats(1.0, 1e6), min_size=1, max_size=8),
    eps=st.sampled_from([0.0, 1e-12, 1e-8, 1e-5, 0.5]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_fast_path_check_implies_eps_rounds_away(
    smallest: float, factors: list[float], eps: float, dtype: torch.dtype
) -> None:
    # The CPU fast path runs torch's fused op (no eps) only where this check passes.
    from normhooks.weight_norm import _eps_vanishes

    norms = torch.tensor([smallest] + [smallest * f for f in factors], dtype=dtype)
    smallest_stored = norms.min().item()
    if _eps_vanishes(smallest_stored, eps, dtype):
        assert torch.equal(norms + eps, norms)
        assert bool((norms > 0).all())


@pytest.mark.parametrize("value", [0.0, float("nan"), -1.0])
def test_fast_path_check_refuses_zero_and_nan_norms(value: float) -> None:
    from normhooks.weight_norm import _eps_vanishes

    assert not _eps_vanishes(value, 0.0, torch.float32)
    assert not _eps_vanishes(value, 1e-12, torch.float64)
