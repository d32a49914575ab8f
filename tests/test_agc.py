"""AdaptiveGradientClipping, agc_ and agc_param_groups: formula, optimizers, AMP, errors."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import assert_compiled_training_matches_eager, assert_grad_scaler_matches_unscaled
from normhooks import (
    AdaptiveGradientClipping,
    GradientLARS,
    agc_,
    agc_param_groups,
    apply_weight_standardization,
)


def reference(
    w: torch.Tensor, g: torch.Tensor, clipping: float = 0.01, eps: float = 1e-3
) -> tuple[torch.Tensor, float]:
    """The clipped gradient and the largest ratio, from the paper's formula in float64.

    Units as in timm's ``unitwise_norm``: the rows along dim 0 of a tensor with at least two
    dimensions, the whole tensor otherwise.
    """
    w64, g64 = w.detach().double(), g.double()
    rows = 1 if w64.ndim < 2 else w64.shape[0]
    size = w64.numel() // rows if rows else 0
    w_rows, g_rows = w64.reshape(rows, size), g64.reshape(rows, size).clone()
    ratios = []
    for i in range(rows):
        w_norm = max(w_rows[i].norm().item(), eps)
        g_norm = g_rows[i].norm().item()
        ratios.append(g_norm / w_norm)
        if g_norm / w_norm > clipping:
            g_rows[i] *= clipping * w_norm / g_norm
    return g_rows.reshape(g.shape), max(ratios, default=0.0)


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


@pytest.mark.parametrize("shape", [(3, 4), (5,), (), (2, 3, 3)], ids=str)
def test_zero_gradients_stay_zero_without_nan(shape: tuple[int, ...]) -> None:
    for weight_value in (0.0, 1.0):
        param = nn.Parameter(torch.full(shape, weight_value))
        param.grad = torch.zeros(shape)
        ratios = agc_([param])
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


def test_returns_ratios_in_parameter_order_across_dtypes() -> None:
    params = [
        param_with_grad(4, 3),
        param_with_grad(5, dtype=torch.float64),
        param_with_grad(2, 2, 2),
        param_with_grad(3, dtype=torch.float64),
    ]
    expected = [reference(p, p.grad)[1] for p in params]
    ratios = agc_(params)
    assert ratios.dtype == torch.float64
    torch.testing.assert_close(
        ratios, torch.tensor(expected, dtype=torch.float64), rtol=2e-6, atol=0
    )


def test_single_tensor_generator_and_missing_grads() -> None:
    first, second, third = param_with_grad(3, 2), param_with_grad(4), param_with_grad(2)
    second.grad = None
    expected = [reference(p, p.grad)[1] for p in (first, third)]
    ratios = agc_(p for p in (first, second, third))
    torch.testing.assert_close(ratios, torch.tensor(expected), rtol=2e-6, atol=0)
    assert second.grad is None
    assert agc_(torch.nn.Parameter(torch.ones(2))).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("foreach", [None, True, False], ids=["auto", "foreach", "loop"])
def test_half_precision_computed_in_float32_and_rounded_once(
    dtype: torch.dtype, foreach: bool | None
) -> None:
    params = [param_with_grad(6, 5, dtype=dtype, g_scale=0.1), param_with_grad(7, dtype=dtype)]
    expected = [reference(p, p.grad)[0].to(dtype) for p in params]
    ratios = agc_(params, foreach=foreach)
    assert ratios.dtype == torch.float32
    for param, grad in zip(params, expected, strict=True):
        # Rounded once from float32: at most one unit in the last place from the float64 result.
        ulp = torch.finfo(dtype).eps * grad.float().abs().max().item()
        torch.testing.assert_close(param.grad.float(), grad.float(), rtol=0, atol=ulp)


# --- the hook ------------------------------------------------------------------------------


def grads_seen_by_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(
        lambda opt, *_: seen.extend(p.grad.clone() for g in opt.param_groups for p in g["params"])
    )
    return seen


def test_hook_clips_before_the_step() -> None:
    params = [param_with_grad(4, 3, g_scale=0.5), param_with_grad(3, g_scale=0.5)]
    expected = [reference(p, p.grad, clipping=0.05)[0] for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    hook = AdaptiveGradientClipping(clipping=0.05)
    hook.attach(optimizer)
    seen = grads_seen_by_step(optimizer)
    optimizer.step()
    for got, grad in zip(seen, expected, strict=True):
        torch.testing.assert_close(got.double(), grad, rtol=2e-6, atol=1e-9)
    assert repr(hook) == "AdaptiveGradientClipping(clipping=0.05, eps=0.001)"
    assert (hook.clipping, hook.eps) == (0.05, 1e-3)


def test_group_opt_out_and_overrides() -> None:
    first, second, third = (param_with_grad(5, 4) for _ in range(3))
    with torch.no_grad():
        second.zero_()
    expected = [
        reference(first, first.grad, clipping=0.02)[0],
        reference(second, second.grad, clipping=0.02, eps=0.5)[0],
        third.grad.double(),
    ]
    optimizer = torch.optim.SGD(
        [
            {"params": [first], "agc_clipping": 0.02},
            {"params": [second], "agc_clipping": 0.02, "agc_eps": 0.5},
            {"params": [third], "agc": False},
        ],
        lr=0.0,
    )
    hook = AdaptiveGradientClipping()
    hook.attach(optimizer)
    optimizer.step()
    for param, grad in zip((first, second, third), expected, strict=True):
        torch.testing.assert_close(param.grad.double(), grad, rtol=2e-6, atol=1e-9)
    assert [r.numel() for r in hook.last_ratios] == [1, 1, 0]


def test_last_ratios_per_group() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1
    )
    hook = AdaptiveGradientClipping()
    hook.attach(optimizer)
    model(torch.randn(4, 5)).square().mean().backward()
    expected = [[reference(p, p.grad)[1] for p in m.parameters()] for m in (model[0], model[2])]
    optimizer.step()
    for got, want in zip(hook.last_ratios, expected, strict=True):
        torch.testing.assert_close(got, torch.tensor(want), rtol=2e-6, atol=0)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    ],
    ids=["sgd-foreach", "sgd-loop", "adamw", "adam-fused"],
)
def test_composes_with_optimizers(make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
    """Training with the hook equals clipping by the float64 formula, then the plain step."""
    model = mlp()
    plain = copy.deepcopy(model)
    optimizer, plain_optimizer = (
        make_optimizer(model.parameters()),
        make_optimizer(plain.parameters()),
    )
    AdaptiveGradientClipping(clipping=0.02).attach(optimizer)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(16, 5, generator=generator)
        for net, opt in ((model, optimizer), (plain, plain_optimizer)):
            opt.zero_grad()
            net(x).square().mean().backward()
        for param in plain.parameters():
            param.grad = reference(param, param.grad, clipping=0.02)[0].float()
        optimizer.step()
        plain_optimizer.step()
    for got, expected in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
def test_step_with_closure_matches_grads_first(positional: bool) -> None:
    model = mlp()
    reference_model = copy.deepcopy(model)
    x = torch.randn(16, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1, momentum=0.9)
    AdaptiveGradientClipping().attach(optimizer)
    AdaptiveGradientClipping().attach(reference_optimizer)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        loss = optimizer.step(closure) if positional else optimizer.step(closure=closure)
        reference_optimizer.zero_grad()
        expected = reference_model(x).square().mean()
        expected.backward()
        reference_optimizer.step()
        torch.testing.assert_close(loss, expected)
    assert calls == [1, 1]
    for got, want in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


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


# --- AMP -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer_class",
    [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD],
    ids=["adam", "adamw", "sgd"],
)
def test_fused_optimizers_under_grad_scaler_match_unscaled(
    optimizer_class: type[torch.optim.Optimizer],
) -> None:
    """Clipped and opted-out groups both reach the fused step unscaled."""

    def make(fused: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        def build(m: nn.Module) -> torch.optim.Optimizer:
            optimizer = optimizer_class(agc_param_groups(m), lr=1e-2, fused=fused)
            AdaptiveGradientClipping(clipping=0.02).attach(optimizer)
            return optimizer

        return build

    assert_grad_scaler_matches_unscaled(
        mlp(), torch.randn(16, 5), make(True), make(False), rtol=1e-6, atol=1e-7
    )


def test_fp16_fused_adam_under_grad_scaler_matches_float32_formula() -> None:
    embedding = nn.Embedding(100, 16).half()
    start = embedding.weight.detach().float().clone()
    optimizer = torch.optim.Adam(embedding.parameters(), lr=1e-3, fused=True)
    AdaptiveGradientClipping(clipping=1e-3).attach(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.get_scale()
    tokens = torch.randint(0, 100, (64,))
    scaler.scale(embedding(tokens).float().square().mean()).backward()
    true_grad = embedding.weight.grad.float() / scale
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == scale  # the step was not skipped
    expected = nn.Parameter(start.clone())
    expected.grad = reference(start, true_grad, clipping=1e-3)[0].float().half().float()
    torch.optim.Adam([expected], lr=1e-3).step()
    torch.testing.assert_close(embedding.weight.detach(), expected.detach().half(), rtol=0, atol=0)


def test_fused_amp_path_keeps_small_half_precision_gradients() -> None:
    """True gradients below float16's range are unscaled in float32, not in the grad's dtype."""
    param = nn.Parameter(torch.full((2, 1000), 1e-3, dtype=torch.float16))
    scale = torch.tensor(65536.0)
    true_grad = torch.full((2, 1000), 2e-8)  # below float16's smallest subnormal, 6e-8
    param.grad = (true_grad * scale).to(torch.float16)
    expected, ratio = reference(param, param.grad.float() / scale, clipping=1e-2, eps=1e-4)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.grad_scale = scale  # what GradScaler sets for a fused optimizer
    hook = AdaptiveGradientClipping(clipping=1e-2, eps=1e-4)
    hook.attach(optimizer)
    hook._pre_step(optimizer, (optimizer,), {})
    assert optimizer.grad_scale is None
    assert ratio > 0  # unscaled in float16 first, the gradients would be zero, and so the ratio
    torch.testing.assert_close(hook.last_ratios[0].double(), torch.tensor([ratio]).double())
    torch.testing.assert_close(param.grad, expected.to(torch.float16), rtol=0, atol=0)


def overflowing_fused_step(inf_in_grad: bool) -> tuple[nn.Parameter, torch.optim.Optimizer, float]:
    param = nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    AdaptiveGradientClipping().attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((param.float() * torch.randn(4, 4)).sum()).backward()
    if inf_in_grad:
        param.grad[0, 0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    return param, optimizer, scaler.get_scale()


def test_inf_gradient_skips_the_fused_step_once() -> None:
    param, optimizer, scale = overflowing_fused_step(inf_in_grad=True)
    torch.testing.assert_close(param.detach(), torch.ones(4, 4, dtype=torch.float16))
    assert optimizer.state[param]["step"].item() == 0
    assert scale == 512.0


def test_finite_gradient_takes_the_fused_step() -> None:
    param, optimizer, scale = overflowing_fused_step(inf_in_grad=False)
    assert optimizer.state[param]["step"].item() == 1
    assert scale == 1024.0


def test_bf16_model_trains_like_float32_within_rounding() -> None:
    model = mlp()
    low = copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    low_optimizer = torch.optim.SGD(low.parameters(), lr=0.1)
    AdaptiveGradientClipping(clipping=0.05).attach(optimizer)
    AdaptiveGradientClipping(clipping=0.05).attach(low_optimizer)
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        low_param.grad = torch.randn_like(param).to(torch.bfloat16)
        param.grad = low_param.grad.float()
        with torch.no_grad():
            param.copy_(low_param.float())
    optimizer.step()
    low_optimizer.step()
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        torch.testing.assert_close(low_param.float(), param, rtol=1.6e-2, atol=1e-2)


# --- torch.compile -------------------------------------------------------------------------


def test_compiled_training_step_matches_eager() -> None:
    def make(m: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(agc_param_groups(m), lr=0.1, momentum=0.9)
        AdaptiveGradientClipping(clipping=0.02).attach(optimizer)
        return optimizer

    assert_compiled_training_matches_eager(mlp(), torch.randn(16, 5), make, rtol=1e-5, atol=1e-6)


def test_hook_traces_without_graph_breaks() -> None:
    """fullgraph=True fails on .item() or Python branches on tensor values: no host sync."""
    torch._dynamo.reset()
    params = [param_with_grad(8, 4), param_with_grad(4), param_with_grad(3, 3, 3)]
    expected = [reference(p, p.grad, clipping=0.1)[0] for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    hook = AdaptiveGradientClipping(clipping=0.1)
    hook.attach(optimizer)
    torch.compile(hook._pre_step, backend="aot_eager", fullgraph=True)(optimizer, (optimizer,), {})
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad.float())


def test_functional_traces_without_graph_breaks() -> None:
    torch._dynamo.reset()
    params = [param_with_grad(8, 4), param_with_grad(4)]
    expected = [reference(p, p.grad, clipping=0.1)[0] for p in params]
    torch.compile(agc_, backend="aot_eager", fullgraph=True)(params, clipping=0.1)
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad.float())


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
        ({"eps": 0.0}, ValueError, r"eps must be positive, got eps=0.0"),
        ({"eps": math.nan}, ValueError, r"eps must be finite"),
        ({"eps": True}, TypeError, r"eps must be a real number, got eps=True"),
        ({"foreach": 1}, TypeError, r"foreach must be a bool or None, got foreach=1"),
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


def test_functional_checks_parameters() -> None:
    with pytest.raises(TypeError, match="parameters must be a tensor or an iterable of tensors"):
        agc_(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parameters\[1\] must be a torch.Tensor, got str"):
        agc_([param_with_grad(2), "w"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"parameters\[0\] must be a real floating-point tensor"):
        agc_([torch.ones(2, dtype=torch.complex64)])


def test_sparse_gradient_refused_and_nothing_changed() -> None:
    dense = param_with_grad(3, 4)
    grad = dense.grad.clone()
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"parameters\[1\] has a torch.sparse_coo gradient"):
        agc_([dense, embedding.weight])
    assert torch.equal(dense.grad, grad)


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [
        ({"agc": 1}, TypeError, r'param group 0: "agc" must be a bool, got "agc"=1'),
        ({"agc_clip": 0.1}, ValueError, r"unknown key 'agc_clip'; expected one of 'agc_clipping'"),
        ({"agc_clipping": 0}, ValueError, r"param group 0: agc_clipping must be positive"),
        ({"agc_eps": -1.0}, ValueError, r"param group 0: agc_eps must be positive"),
    ],
    ids=["enabled-not-bool", "unknown-key", "clipping", "eps"],
)
def test_bad_groups_refused_at_attach(
    group: dict[str, Any], error: type[Exception], match: str
) -> None:
    optimizer = torch.optim.SGD([{"params": mlp().parameters(), **group}], lr=0.1)
    with pytest.raises(error, match=match):
        AdaptiveGradientClipping().attach(optimizer)


def test_bad_group_added_later_refused_before_any_change() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    AdaptiveGradientClipping().attach(optimizer)
    optimizer.add_param_group({"params": model[2].parameters(), "agc_eps": 0.0})
    model(torch.randn(4, 5)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="param group 1: agc_eps must be positive"):
        optimizer.step()
    for param, grad in zip(model.parameters(), grads, strict=True):
        assert torch.equal(param.grad, grad)


def test_attach_errors() -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, got list"):
        AdaptiveGradientClipping().attach([])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be attached to LBFGS"):
        AdaptiveGradientClipping().attach(torch.optim.LBFGS(mlp().parameters()))
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    AdaptiveGradientClipping().attach(optimizer)
    with pytest.raises(RuntimeError, match=r"another AdaptiveGradientClipping .* apply AGC twice"):
        AdaptiveGradientClipping().attach(optimizer)


def test_duplicate_tensor_refused() -> None:
    param = param_with_grad(3, 2)
    with pytest.raises(ValueError, match=r"parameters\[1\] is the same tensor as parameters\[0\]"):
        agc_([param, param])


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


def test_fused_grad_scaler_with_float64_default_dtype() -> None:
    """The flags AGC makes for GradScaler's op are float32 whatever the default dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = nn.Linear(3, 2).float()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        AdaptiveGradientClipping().attach(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(model(torch.randn(4, 3, dtype=torch.float32)).sum()).backward()
        scaler.step(optimizer)
    finally:
        torch.set_default_dtype(default)
    assert all(torch.isfinite(p).all() for p in model.parameters())
