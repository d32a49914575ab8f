"""AdaptiveGradientClipping, agc_ and agc_param_groups: the formula and its units, NF-Net
training, settings and errors. What every hook shares is in test_hook_contract.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hook_kinds import agc_rows
from normhooks import (
    AdaptiveGradientClipping,
    GradientLARS,
    agc_,
    agc_param_groups,
    apply_weight_standardization,
)
from normhooks._step_hook import euclidean_norms
from normhooks.agc import AGCSettings, agc_unit_


def reference(
    w: torch.Tensor, g: torch.Tensor, clipping: float = 0.01, eps: float = 1e-3
) -> tuple[torch.Tensor, float]:
    """The clipped gradient and the largest ratio, from the paper's formula in float64 (units
    as in timm's ``unitwise_norm``: the rows along dim 0 of a tensor of 2 or more dims, the
    whole tensor otherwise)."""
    clipped, ratios = agc_rows(w, g, clipping=clipping, eps=eps)
    return clipped, max(ratios, default=0.0)


def param_with_grad(
    *shape: int, dtype: torch.dtype = torch.float32, w_scale: float = 1.0, g_scale: float = 1.0
) -> nn.Parameter:
    param = nn.Parameter(torch.randn(shape, dtype=dtype) * w_scale)
    param.grad = torch.randn(shape, dtype=dtype) * g_scale
    return param


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def assert_matches_reference(
    params: list[nn.Parameter],
    grads: list[torch.Tensor],
    ratios: torch.Tensor,
    clipping: float,
    eps: float,
    rtol: float,
) -> None:
    expected = [reference(p, g, clipping, eps) for p, g in zip(params, grads, strict=True)]
    torch.testing.assert_close(
        ratios.double(),
        torch.tensor([r for _, r in expected], dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )
    for param, (grad, _) in zip(params, expected, strict=True):
        scale = grad.abs().max().item() if grad.numel() else 0.0
        torch.testing.assert_close(param.grad.double(), grad, rtol=rtol, atol=rtol * scale)


# --- the formula ---------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(deadline=None, max_examples=80)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=5),
    clipping=st.sampled_from([1e-3, 0.01, 0.16, 1.0, 10.0]),
    eps=st.sampled_from([1e-3, 0.1, 1.0]),
    w_scale=st.sampled_from([0.0, 1e-3, 1.0, 10.0]),
    g_scale=st.sampled_from([0.0, 1e-4, 1e-2, 1.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    foreach=st.sampled_from([None, True, False]),
    seed=st.integers(0, 2**16),
)
def test_agc_matches_formula(
    shape_list: list[tuple[int, ...]],
    clipping: float,
    eps: float,
    w_scale: float,
    g_scale: float,
    dtype: torch.dtype,
    foreach: bool | None,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    params = [
        param_with_grad(*s, dtype=dtype, w_scale=w_scale, g_scale=g_scale) for s in shape_list
    ]
    grads = [p.grad.clone() for p in params]
    ratios = agc_(params, clipping, eps, foreach=foreach)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    assert_matches_reference(params, grads, ratios, clipping, eps, rtol)


@pytest.mark.parametrize(
    "layer",
    [nn.Conv2d(3, 5, 3), nn.Conv1d(2, 4, 5), nn.Conv3d(2, 3, 2), nn.Linear(6, 4)],
    ids=["conv2d", "conv1d", "conv3d", "linear"],
)
def test_units_are_output_rows(layer: nn.Module) -> None:
    """One row per output channel: norms over every dim but 0, as timm's unitwise_norm."""
    weight = layer.weight
    weight.grad = torch.randn_like(weight)
    with torch.no_grad():
        weight[0].zero_()  # one unit below eps, one clipped hard, one left alone
        weight.grad[1] *= 1e-6
    grads = [weight.grad.clone()]
    ratios = agc_([weight], clipping=0.05)
    assert_matches_reference([weight], grads, ratios, 0.05, 1e-3, 2e-6)
    norms = torch.linalg.vector_norm(weight.grad, dim=tuple(range(1, weight.ndim)))
    torch.testing.assert_close(norms[0], torch.tensor(0.05 * 1e-3))  # max(||W_0||, eps) = eps
    torch.testing.assert_close(weight.grad[1], grads[0][1], rtol=0, atol=0)


def test_one_dimensional_parameter_is_one_unit() -> None:
    bias = nn.Parameter(torch.tensor([3.0, 4.0]))
    bias.grad = torch.tensor([1.0, 0.0])
    ratio = agc_(bias, clipping=0.1)
    torch.testing.assert_close(ratio, torch.tensor([0.2]))
    torch.testing.assert_close(bias.grad, torch.tensor([0.5, 0.0]))  # to norm 0.1 * 5


def test_zero_dimensional_parameter() -> None:
    scalar = nn.Parameter(torch.tensor(-2.0))
    scalar.grad = torch.tensor(1.0)
    assert agc_(scalar, clipping=0.25).tolist() == [0.5]
    assert scalar.grad.item() == 0.5


def test_zero_weights_count_as_eps() -> None:
    weight = nn.Parameter(torch.zeros(3, 4))
    weight.grad = torch.full((3, 4), 1.0)
    ratios = agc_([weight], clipping=0.01, eps=1e-3)
    torch.testing.assert_close(ratios, torch.tensor([2.0 / 1e-3]))
    torch.testing.assert_close(weight.grad, torch.full((3, 4), 1e-5 / 2))


def test_without_a_floor_a_zero_unit_is_clipped_to_zero() -> None:
    weight = nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]))
    weight.grad = torch.tensor([[30.0, 40.0], [1.0, 2.0], [0.0, 0.0]])
    ratios = agc_([weight], clipping=0.1, eps=0.0)
    assert ratios.tolist() == [math.inf]
    torch.testing.assert_close(weight.grad, torch.tensor([[0.3, 0.4], [0.0, 0.0], [0.0, 0.0]]))


def test_without_a_floor_a_zero_unit_never_moves_under_the_hook() -> None:
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight[1] = 0.0
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9)
    hook = AdaptiveGradientClipping(clipping=0.01, eps=0.0)
    hook.attach(optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
    assert torch.equal(layer.weight[1], torch.zeros(3))
    assert layer.weight[0].ne(0).all()
    assert hook.last_ratios[0][0].item() == math.inf  # the weight's largest: its zero row


@pytest.mark.parametrize("eps", [1e-3, 0.0], ids=["eps", "no-floor"])
@pytest.mark.parametrize("shape", [(3, 4), (5,), (), (2, 3, 3)], ids=str)
def test_zero_gradients_stay_zero_without_nan(shape: tuple[int, ...], eps: float) -> None:
    for weight_value in (0.0, 1.0):
        param = nn.Parameter(torch.full(shape, weight_value))
        param.grad = torch.zeros(shape)
        ratios = agc_([param], eps=eps)
        assert torch.equal(param.grad, torch.zeros(shape))
        assert ratios.tolist() == [0.0]


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0,)], ids=str)
def test_zero_size_parameters(shape: tuple[int, ...]) -> None:
    param = param_with_grad(*shape)
    other = param_with_grad(2, 2, g_scale=10.0)
    grads = [param.grad.clone(), other.grad.clone()]
    ratios = agc_([param, other])
    assert ratios[0].item() == 0.0
    assert_matches_reference([param, other], grads, ratios, 0.01, 1e-3, 2e-6)


def test_gradient_at_the_threshold_is_unchanged() -> None:
    """timm clips only where ||G|| >= max_norm, by max_norm / ||G|| = 1 there: no change."""
    weight = nn.Parameter(torch.tensor([[3.0, 4.0]]))
    weight.grad = torch.tensor([[1.5, 2.0]])  # ||G|| = 2.5 = 0.5 * ||W||, all exact
    grad = weight.grad.clone()
    assert agc_([weight], clipping=0.5).tolist() == [0.5]
    torch.testing.assert_close(weight.grad, grad, rtol=0, atol=0)


def test_no_division_floor_for_tiny_clipping_times_eps() -> None:
    """timm and optax divide by max(||G||, 1e-6); here a gradient above a threshold below 1e-6
    is clipped to the threshold exactly, as the formula says."""
    weight = nn.Parameter(torch.zeros(1, 4, dtype=torch.float64))
    weight.grad = torch.full((1, 4), 2e-7, dtype=torch.float64)  # ||G|| = 4e-7
    agc_([weight], clipping=1e-2, eps=1e-5)  # threshold 1e-7
    torch.testing.assert_close(weight.grad.norm(), torch.tensor(1e-7, dtype=torch.float64))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_gradients_stay_non_finite(bad: float) -> None:
    weight = param_with_grad(3, 4)
    weight.grad[1, 2] = bad
    agc_([weight])
    assert not torch.isfinite(weight.grad[1]).all()
    assert torch.isfinite(weight.grad[[0, 2]]).all()


# --- scaled gradients (GradScaler's fused protocol), the plain path -------------------------


def _unit(
    dtype: torch.dtype, scale: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Parameters, their true gradients and those gradients times ``scale``."""
    params = [torch.randn(shape).to(dtype) for shape in [(3, 5), (4,), (), (2, 3, 2)]]
    true = [(0.05 * torch.randn(p.shape)).to(dtype) for p in params]
    return params, true, [(g.double() * scale).to(dtype) for g in true]


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "norms-given"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"]
)
def test_scaled_gradients_on_the_plain_path_give_the_unscaled_result(
    dtype: torch.dtype, sharded: bool
) -> None:
    """AGC takes GradScaler's scaled gradients itself (as its kernel does): without the kernel
    it unscales them as the step hook would, reads its shards' whole norms (of the scaled
    gradients) divided by the scale, and writes the unscaled result."""
    params, true, scaled = _unit(dtype, 1024.0)
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})

    def norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not sharded:
            return None
        return euclidean_norms(params), euclidean_norms(grads)

    want = agc_unit_(params, true, settings, None, norms=norms(true), foreach=None)
    found_inf = torch.zeros(())
    got = agc_unit_(
        params, scaled, settings, None, norms=norms(scaled), foreach=None,
        grad_scale=torch.tensor(1024.0), found_inf=found_inf,
    )  # fmt: skip
    torch.testing.assert_close(got, want)
    for grad, expected in zip(scaled, true, strict=True):
        torch.testing.assert_close(grad, expected)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_scaled_gradient_raises_the_flag_on_the_plain_path(bad: float) -> None:
    params, _, scaled = _unit(torch.float32, 8.0)
    scaled[0][1, 2] = bad
    found_inf = torch.zeros(())
    settings = AGCSettings._checked({"clipping": 0.01, "eps": 1e-3})
    agc_unit_(
        params, scaled, settings, None, norms=None, foreach=None,
        grad_scale=torch.tensor(8.0), found_inf=found_inf,
    )  # fmt: skip
    assert found_inf.item() == 1.0


# --- the hook ------------------------------------------------------------------------------


def grads_seen_by_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(
        lambda opt, *_: seen.extend(p.grad.clone() for g in opt.param_groups for p in g["params"])
    )
    return seen


def test_shares_an_optimizer_with_lars_in_attach_order() -> None:
    param = param_with_grad(4, 3, g_scale=0.5)
    clipped, _ = reference(param, param.grad, clipping=0.05)
    w_norm, g_norm = param.detach().double().norm(), clipped.norm()
    expected = clipped * (w_norm / (g_norm + 1e-9))
    optimizer = torch.optim.SGD([param], lr=0.1)
    AdaptiveGradientClipping(clipping=0.05).attach(optimizer)
    GradientLARS().attach(optimizer)
    seen = grads_seen_by_step(optimizer)
    optimizer.step()
    torch.testing.assert_close(seen[0].double(), expected, rtol=2e-6, atol=1e-9)


# --- agc_param_groups ----------------------------------------------------------------------


def classifier() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)
    )


def test_agc_param_groups_leaves_out_the_last_linear() -> None:
    model = classifier()
    groups = agc_param_groups(model)
    assert [g.get("agc", True) for g in groups] == [True, False]
    assert groups[1]["params"] == [model[5].weight, model[5].bias]
    assert groups[0]["params"] == [*model[0].parameters(), *model[3].parameters()]


def test_agc_param_groups_by_module_name_and_predicate() -> None:
    model = nn.Sequential()
    model.add_module("body", nn.Linear(4, 4))
    model.add_module("head", nn.Conv2d(4, 2, 1))
    assert agc_param_groups(model, exclude="head")[1]["params"] == list(model.head.parameters())
    by_name = agc_param_groups(model, exclude=lambda name, _: name.endswith("bias"))
    assert by_name[1]["params"] == [model.body.bias, model.head.bias]


def test_agc_param_groups_follows_a_parametrized_classifier() -> None:
    model = classifier()
    torch.nn.utils.parametrizations.weight_norm(model[5])
    groups = agc_param_groups(model)
    assert len(groups[1]["params"]) == 3  # g, v and the bias
    assert set(map(id, groups[1]["params"])) == set(map(id, model[5].parameters()))


def test_agc_param_groups_leaves_out_empty_groups() -> None:
    only = nn.Linear(3, 2)
    assert agc_param_groups(only) == [{"params": list(only.parameters()), "agc": False}]
    assert agc_param_groups(only, exclude=lambda *_: False) == [{"params": list(only.parameters())}]


def test_nf_net_style_training() -> None:
    """Scaled WS + AGC without normalization layers (the README example) learns."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    apply_weight_standardization(model, scaled=True, gamma=1.7015)
    optimizer = torch.optim.SGD(agc_param_groups(model), lr=0.1, momentum=0.9, nesterov=True)
    hook = AdaptiveGradientClipping(clipping=0.01)
    hook.attach(optimizer)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,))
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert (hook.last_ratios[0] > 0).all()
    assert hook.last_ratios[1].numel() == 0


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clipping": 0.0}, ValueError, r"clipping must be positive, got clipping=0.0"),
        ({"clipping": -1}, ValueError, r"clipping must be positive, got clipping=-1"),
        ({"clipping": math.inf}, ValueError, r"clipping must be finite"),
        ({"clipping": "0.01"}, TypeError, r"clipping must be a real number, got clipping='0.01'"),
        ({"eps": -1e-3}, ValueError, r"eps must be non-negative, got eps=-0.001"),
        ({"eps": math.nan}, ValueError, r"eps must be finite"),
        ({"eps": True}, TypeError, r"eps must be a real number, got eps=True"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
@pytest.mark.parametrize("entry", ["hook", "functional"])
def test_argument_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str, entry: str
) -> None:
    param = param_with_grad(3, 2)
    grad = param.grad.clone()
    make: Callable[[], object] = (
        (lambda: AdaptiveGradientClipping(**kwargs))
        if entry == "hook"
        else (lambda: agc_([param], **kwargs))
    )
    with pytest.raises(error, match=match):
        make()
    assert torch.equal(param.grad, grad)


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [
        ({"agc_clip": 0.1}, ValueError, r"unknown key 'agc_clip'; expected one of 'agc_clipping'"),
        ({"agc_clipping": 0}, ValueError, r"param group 0: agc_clipping must be positive"),
        ({"agc_eps": -1.0}, ValueError, r"param group 0: agc_eps must be non-negative"),
    ],
    ids=["near-miss-key", "clipping", "eps"],
)
def test_bad_groups_refused_at_attach(
    group: dict[str, Any], error: type[Exception], match: str
) -> None:
    optimizer = torch.optim.SGD([{"params": mlp().parameters(), **group}], lr=0.1)
    with pytest.raises(error, match=match):
        AdaptiveGradientClipping().attach(optimizer)


def test_agc_param_groups_errors() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got list"):
        agc_param_groups([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model has no nn.Linear"):
        agc_param_groups(nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match=r"exclude='fc' names no submodule .* \['0', '1', '2'"):
        agc_param_groups(mlp(), exclude="fc")
    with pytest.raises(TypeError, match="exclude must be a module name, a callable"):
        agc_param_groups(mlp(), exclude=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"exclude must return a bool, got torch.Tensor"):
        agc_param_groups(mlp(), exclude=lambda _, p: p.sum() > 0)  # type: ignore[arg-type,return-value]
