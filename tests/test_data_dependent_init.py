"""The data-dependent initialization of weight-normalized layers (paper, section 3)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from normhooks import (
    apply_weight_norm,
    convert_with_weight_normalization,
    data_dependent_init,
    weight_norm,
)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def cnn() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 6, 2, stride=2),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 14 * 14, 5),
    )
    # One g per output channel: a transposed convolution's dim 1.
    weight_norm(model[2], dim=1)
    return model


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
    model = apply_weight_norm(make())
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
    model = apply_weight_norm(nn.Sequential(nn.Linear(4, 3)))
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

    model = apply_weight_norm(Model())
    for name in ("weight_ih_l0", "weight_hh_l0"):
        weight_norm(model.lstm, name)
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

    model = apply_weight_norm(TwoInputs())
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

    model = apply_weight_norm(Partial())
    g = model.unused.parametrizations.weight.original0.detach().clone()
    with pytest.warns(UserWarning, match="the forward never reached unused"):
        data_dependent_init(model, torch.randn(8, 3))
    torch.testing.assert_close(model.unused.parametrizations.weight.original0, g)


def test_ddi_failed_forward_leaves_model_unchanged() -> None:
    model = apply_weight_norm(mlp())
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
        data_dependent_init(convert_with_weight_normalization(nn.LSTM, 2, 2), torch.randn(3, 1, 2))


def test_ddi_refuses_lazy_layers_not_yet_materialized() -> None:
    model = apply_weight_norm(nn.Sequential(nn.LazyLinear(3)))
    with pytest.raises(ValueError, match=r"0 \(LazyLinear\) is a lazy module .* run one forward"):
        data_dependent_init(model, torch.randn(4, 2))
    model(torch.randn(4, 2))
    data_dependent_init(model, torch.randn(4, 2))


class Doubled(nn.Module):
    """A parametrization on top of weight normalization."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_ddi_errors() -> None:
    with pytest.raises(ValueError, match="scale must be positive, got scale=0"):
        data_dependent_init(apply_weight_norm(mlp()), torch.randn(4, 6), scale=0)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        data_dependent_init("model", torch.randn(4, 6))  # type: ignore[type-var]
    grouped = nn.Sequential(weight_norm(nn.ConvTranspose2d(4, 4, 2, groups=2), dim=1))
    with pytest.raises(ValueError, match=r"cannot initialize 0 \(ConvTranspose2d\): with groups=2"):
        data_dependent_init(grouped, torch.randn(2, 4, 3, 3))
    sideways = apply_weight_norm(nn.Sequential(nn.Linear(3, 2)), dim=1)
    with pytest.raises(ValueError, match=r"0 \(Linear\) is weight-normalized along dim=1"):
        data_dependent_init(sideways, torch.randn(2, 3))
    stacked = apply_weight_norm(nn.Sequential(nn.Linear(3, 2)))
    parametrize.register_parametrization(stacked[0], "weight", Doubled())
    with pytest.raises(ValueError, match=r"needs weight normalization alone on 0 \(Linear\)"):
        data_dependent_init(stacked, torch.randn(2, 3))


def test_ddi_on_unbatched_conv_input() -> None:
    model = apply_weight_norm(nn.Sequential(nn.Conv1d(2, 3, 3)))
    x = torch.randn(2, 50)
    data_dependent_init(model, x)
    y = model(x)
    torch.testing.assert_close(y.std(1, unbiased=False), torch.ones(3), atol=1e-4, rtol=0)


# --- never silently wrong ---------------------------------------------------------------------


def assert_unchanged(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (torch.randn(0, 6), r"needs a non-empty batch, got batch \[0, 6\]"),
        (
            (torch.randn(0, 6),),
            r"needs a non-empty batch, got batch\[0\] \[0, 6\]",
        ),
        (
            torch.randn(8, 6).index_fill_(0, torch.tensor([3]), float("nan")),
            r"needs a finite batch, got 6 NaN or inf values \(batch has 6\)",
        ),
        (
            {"x": torch.randn(8, 6).index_fill_(1, torch.tensor([2]), float("inf"))},
            r"got 8 NaN or inf values \(batch\['x'\] has 8\)",
        ),
    ],
    ids=["empty", "empty-tuple", "nan", "inf-mapping"],
)
def test_ddi_refuses_bad_batches_at_entry(batch: object, match: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    model = apply_weight_norm(Model())
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        data_dependent_init(model, batch)
    assert_unchanged(model, state)


class Overflow(nn.Module):
    """Finite in, inf out: NaN that only the activations show."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3e38


def test_ddi_refuses_non_finite_activations_and_changes_nothing() -> None:
    model = apply_weight_norm(nn.Sequential(nn.Linear(4, 4), Overflow(), nn.Linear(4, 2)))
    state = copy.deepcopy(model.state_dict())
    match = r"the pre-activations of 2 \(Linear\) are not finite .* earlier layer overflowed"
    with pytest.raises(ValueError, match=match):
        data_dependent_init(model, torch.randn(16, 4))
    assert_unchanged(model, state)


def test_ddi_refuses_a_batch_too_small_for_a_variance() -> None:
    model = apply_weight_norm(mlp())
    state = copy.deepcopy(model.state_dict())
    match = r"0 \(Linear\) sees 1 value per unit in this batch .* needs at least 2"
    with pytest.raises(ValueError, match=match):
        data_dependent_init(model, torch.randn(1, 6))
    assert_unchanged(model, state)


def test_ddi_one_image_is_enough_for_a_convolution() -> None:
    # The moments run over the batch and spatial axes: 36 values per channel.
    model = apply_weight_norm(nn.Sequential(nn.Conv2d(3, 4, 3)))
    x = torch.randn(1, 3, 8, 8)
    data_dependent_init(model, x)
    y = model(x).transpose(0, 1).flatten(1)
    torch.testing.assert_close(y.std(1, unbiased=False), torch.ones(4), atol=1e-4, rtol=0)


def test_ddi_warns_about_constant_units() -> None:
    model = apply_weight_norm(nn.Sequential(nn.Linear(3, 2)))
    x = torch.randn(8, 3)
    x[:, :] = x[:1]  # every sample equal: each unit's pre-activation is constant
    match = r"constant pre-activations .*\(0 \(Linear\): 2 of 2 units"
    with pytest.warns(UserWarning, match=match):
        data_dependent_init(model, x)
    g = model[0].parametrizations.weight.original0
    torch.testing.assert_close(g, torch.ones_like(g))


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_ddi_initializes_compiled_models(how: str) -> None:
    torch._dynamo.reset()
    model = apply_weight_norm(mlp())
    if how == "torch.compile":
        compiled = torch.compile(model, backend="aot_eager")
    else:
        model.compile(backend="aot_eager")
        compiled = model
    x = torch.randn(256, 6)
    compiled(x)  # traced and cached before the initialization's hooks exist
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data_dependent_init(compiled, x) is compiled
    outputs = layer_outputs(model, x)
    assert len(outputs) == 3
    for _, y in outputs:
        torch.testing.assert_close(
            y.std(0, unbiased=False), torch.ones(y.shape[1]), atol=1e-4, rtol=0
        )
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_ddi_transposed_layer_in_torchs_layout_says_to_pass_dim_1() -> None:
    model = apply_weight_norm(nn.Sequential(nn.ConvTranspose1d(4, 3, 3)))
    g = model[0].parametrizations.weight.original0.detach().clone()
    match = (
        r"needs one g per output unit, but 0 \(ConvTranspose1d\) is weight-normalized along "
        r"dim=0; a transposed convolution's output channels are dim=1: convert it with "
        r"weight_norm\(layer, dim=1\)"
    )
    with pytest.raises(ValueError, match=match):
        data_dependent_init(model, torch.randn(8, 4, 5))
    torch.testing.assert_close(model[0].parametrizations.weight.original0, g, rtol=0, atol=0)


def test_ddi_names_torchs_weight_norm() -> None:
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(3, 2)))
    match = r"0 \(Linear\) carries torch's weight norm, .*apply_weight_norm\(model\) first"
    with pytest.raises(ValueError, match=match):
        data_dependent_init(model, torch.randn(8, 3))
    apply_weight_norm(model)
    data_dependent_init(model, torch.randn(8, 3))


def test_a_parametrized_bias_is_refused() -> None:
    """DDI sets the bias directly; through a parametrization the layers after it would be
    initialized on outputs the model never produces."""

    class Shift(nn.Module):
        def forward(self, bias: torch.Tensor) -> torch.Tensor:
            return bias + 1.0

    model = apply_weight_norm(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    parametrize.register_parametrization(model[0], "bias", Shift())
    g = model[0].parametrizations.weight.original0.detach().clone()
    with pytest.raises(ValueError, match=r"bias has a parametrization"):
        data_dependent_init(model, torch.randn(64, 4))
    torch.testing.assert_close(model[0].parametrizations.weight.original0, g, rtol=0, atol=0)
