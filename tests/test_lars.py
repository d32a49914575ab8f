"""GradientLARS, lars_ and lars_param_groups: the formula, LARC's clip, LARS's AMP and weight
decay specifics, settings and errors. What every hook shares is in test_hook_contract.py."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hook_kinds import lars_rate
from normhooks import GradientLARS, _kernels, apply_weight_norm, lars_, lars_param_groups


def reference(
    w: torch.Tensor,
    g: torch.Tensor,
    threshold: float = 1e-2,
    weight_decay: float = 0.0,
    eps: float = 1e-9,
    trust_coefficient: float = 1.0,
    clip_lr: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The hooked gradient and the rate, written out in float64 from the paper's formula."""
    settings = {"threshold": threshold, "weight_decay": weight_decay, "eps": eps}
    rate = lars_rate(
        w,
        g,
        1.0 if clip_lr is None else clip_lr,
        trust_coefficient=trust_coefficient,
        clip=clip_lr is not None,
        **settings,
    )
    return rate * (g.double() + weight_decay * w.double()), rate


def param_with_grad(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    param = nn.Parameter(torch.randn(shape, dtype=dtype))
    param.grad = torch.randn(shape, dtype=dtype)
    return param


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


# --- the formula ---------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(deadline=None, max_examples=60)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    threshold=st.sampled_from([0.0, 1e-2, 1.0, 3.0]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.1, 2.0]),
    eps=st.sampled_from([0.0, 1e-9, 1e-3, 1.0]),
    trust_coefficient=st.sampled_from([1e-3, 0.5, 1.0, 4.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_lars_matches_formula(
    shape_list: list[tuple[int, ...]],
    threshold: float,
    weight_decay: float,
    eps: float,
    trust_coefficient: float,
    dtype: torch.dtype,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    params = [param_with_grad(*shape, dtype=dtype) for shape in shape_list]
    expected = [
        reference(p, p.grad, threshold, weight_decay, eps, trust_coefficient) for p in params
    ]
    rates = lars_(params, threshold, weight_decay, eps, trust_coefficient=trust_coefficient)
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(
        rates.double(),
        torch.tensor([r for _, r in expected], dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )
    for param, (grad, _) in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad.double(), grad, rtol=rtol, atol=rtol * 1e-3)


@settings(deadline=None, max_examples=30)
@given(
    lr=st.sampled_from([1e-3, 0.1, 1.0, 10.0]),
    trust_coefficient=st.sampled_from([1e-3, 0.02, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_clip_mode_matches_larc(lr: float, trust_coefficient: float, seed: int) -> None:
    torch.manual_seed(seed)
    params = [param_with_grad(6, 4, dtype=torch.float64), param_with_grad(3, dtype=torch.float64)]
    expected = [
        reference(p, p.grad, trust_coefficient=trust_coefficient, clip_lr=lr) for p in params
    ]
    hook = GradientLARS(trust_coefficient=trust_coefficient, clip=True)
    optimizer = torch.optim.SGD(params, lr=lr)
    hook.attach(optimizer)
    grads_seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(lambda *_: grads_seen.extend(p.grad for p in params))
    optimizer.step()
    for grad, (expected_grad, rate) in zip(grads_seen, expected, strict=True):
        assert rate <= 1.0
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_rates_stay_on_the_first_parameters_device() -> None:
    # meta stands in for an accelerator: a CPU parameter beside it must not pull the rates to
    # the host (reading meta rates back would fail, as reading GPU rates would synchronize).
    params = [nn.Parameter(torch.ones(3, 3, device="meta")), param_with_grad(2, 2)]
    params[0].grad = torch.ones(3, 3, device="meta")
    assert lars_(params).device.type == "meta"


def test_zero_size_tensor_gets_rate_one() -> None:
    param = param_with_grad(0, 4)
    assert lars_([param], threshold=0.0).tolist() == [1.0]


@pytest.mark.parametrize(
    ("eps", "weight_decay"), [(0.0, 0.0), (1e-9, 0.0), (0.0, 1e-3)], ids=["eps0-wd0", "eps", "wd"]
)
def test_zero_grad_gives_no_nan(eps: float, weight_decay: float) -> None:
    param = nn.Parameter(torch.randn(4, 4))
    param.grad = torch.zeros(4, 4)
    lars_([param], eps=eps, weight_decay=weight_decay)
    assert torch.isfinite(param.grad).all()
    expected, _ = reference(
        param, torch.zeros(4, 4), eps=max(eps, 1e-300), weight_decay=weight_decay
    )
    torch.testing.assert_close(param.grad, expected.float())


# --- the zero-gradient rule ------------------------------------------------------------------


def zero_grad_case() -> list[nn.Parameter]:
    """A tensor with a gradient, a zero-gradient one, a zero one and one below the threshold."""
    params = [param_with_grad(3, 4, dtype=torch.float64) for _ in range(4)]
    params[1].grad.zero_()
    params[2].data.zero_()
    params[3].data.mul_(1e-4)
    params[3].grad.zero_()
    return params


def zero_grad_expected(
    params: list[nn.Parameter], mode: str, weight_decay: float
) -> tuple[list[torch.Tensor], list[float]]:
    """The peers' rules written out: "decay" (timm's Lars, torchlars) gives a zero-gradient
    tensor rate 1, "skip" (lightly, solo-learn, apex LARC, torch-optimizer) leaves it as it
    is, which is rate 0 on g + weight_decay * w; "scale" is the formula (Chainer)."""
    grads, rates = [], []
    for p in params:
        grad, rate = reference(p, p.grad, threshold=1e-2, weight_decay=weight_decay, eps=1e-8)
        if p.grad.norm() == 0 and mode != "scale":
            rate = 1.0 if mode == "decay" else 0.0
            grad = rate * (p.grad + weight_decay * p.detach())
        grads.append(grad)
        rates.append(rate)
    return grads, rates


@pytest.mark.parametrize("path", ["eager", "kernel"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2], ids=["no-decay", "decay"])
@pytest.mark.parametrize("mode", ["scale", "decay", "skip"])
def test_zero_grad_mode(mode: str, weight_decay: float, path: str) -> None:
    params = zero_grad_case()
    expected, expected_rates = zero_grad_expected(params, mode, weight_decay)
    if path == "kernel":
        pytest.importorskip("triton")
        with _kernels.route_cpu_tensors():
            rates = lars_(params, 1e-2, weight_decay, 1e-8, zero_grad_mode=mode)  # type: ignore[arg-type]
    else:
        rates = lars_(params, 1e-2, weight_decay, 1e-8, zero_grad_mode=mode)  # type: ignore[arg-type]
    torch.testing.assert_close(rates, torch.tensor(expected_rates, dtype=torch.float64))
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-13, atol=0.0)


def test_skip_leaves_a_zero_gradient_tensor_where_it_is_under_momentum() -> None:
    params = zero_grad_case()
    start = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    GradientLARS(threshold=0.0, weight_decay=1e-2, zero_grad_mode="skip").attach(optimizer)
    optimizer.step()
    for i in (1, 3):
        assert torch.equal(params[i].detach(), start[i])
    assert not torch.equal(params[0].detach(), start[0])


@pytest.mark.parametrize("path", ["eager", "kernel"])
def test_group_override_of_zero_grad_mode(path: str) -> None:
    skipped, scaled = zero_grad_case()[1], zero_grad_case()[1]
    optimizer = torch.optim.SGD(
        [{"params": [skipped], "lars_zero_grad_mode": "skip"}, {"params": [scaled]}], lr=0.1
    )
    hook = GradientLARS(weight_decay=1e-2)
    hook.attach(optimizer)
    if path == "kernel":
        pytest.importorskip("triton")
        with _kernels.route_cpu_tensors():
            optimizer.step()
    else:
        optimizer.step()
    assert hook.last_rates[0].tolist() == [0.0]
    assert hook.last_rates[1].item() == pytest.approx(1.0 / (1e-9 / scaled.norm().item() + 1e-2))


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_non_finite_grads_stay_non_finite(bad: float) -> None:
    param = param_with_grad(3, 3)
    param.grad[1, 1] = bad
    lars_([param])
    assert not torch.isfinite(param.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_matches_float32_within_rounding(dtype: torch.dtype) -> None:
    param = nn.Parameter(torch.randn(64, 32).to(dtype))
    param.grad = torch.randn(64, 32).to(dtype)
    expected, rate = reference(param.float(), param.grad.float(), weight_decay=1e-2)
    rates = lars_([param], weight_decay=1e-2)
    assert rates.dtype == torch.float32
    torch.testing.assert_close(rates, torch.tensor([rate], dtype=torch.float32))
    # One rounding to the dtype: exactly the float32 result rounded.
    torch.testing.assert_close(param.grad, expected.to(dtype), rtol=0, atol=0)


# --- the hook ------------------------------------------------------------------------------


def test_group_override_of_clip() -> None:
    param = param_with_grad(5, 5, dtype=torch.float64)
    expected, _ = reference(param, param.grad, clip_lr=100.0)
    optimizer = torch.optim.SGD([{"params": [param], "lars_clip": True}], lr=100.0)
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(lambda *_: seen.append(param.grad.clone()))
    GradientLARS().attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(seen[0], expected)


def test_lars_param_groups_default_rule() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    groups = lars_param_groups(model)
    assert [g.get("lars", True) for g in groups] == [True, False]
    assert {id(p) for p in groups[0]["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert {id(p) for p in groups[1]["params"]} == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[3].bias),
    }


def test_lars_param_groups_exclude_replaces_rule() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    groups = lars_param_groups(model, exclude=lambda name, _: name.startswith("1."))
    assert [len(g["params"]) for g in groups] == [2, 2]
    assert groups[1]["lars"] is False
    assert groups[1]["params"][0] is model[1].weight


def test_lars_param_groups_leaves_gains_alone() -> None:
    model = apply_weight_norm(nn.Sequential(nn.Conv2d(3, 8, 3)))
    groups = lars_param_groups(model)
    skipped = {id(p) for p in groups[1]["params"]}
    assert id(model[0].parametrizations.weight.original0) in skipped
    assert id(model[0].parametrizations.weight.original1) not in skipped


def test_lars_param_groups_by_module_leaves_out_norm_layers_and_biases() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(4), nn.Linear(4, 1)
    )
    groups = lars_param_groups(model, by="module")
    assert [g.get("lars", True) for g in groups] == [True, False]
    # The (1, 4) head weight is scaled, which the shape rule leaves out.
    assert {id(p) for p in groups[0]["params"]} == {id(model[0].weight), id(model[4].weight)}
    assert {id(p) for p in lars_param_groups(model)[0]["params"]} == {id(model[0].weight)}


def test_lars_param_groups_by_module_scales_weight_norms_g() -> None:
    model = apply_weight_norm(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False)))
    (group,) = lars_param_groups(model, by="module")
    assert len(group["params"]) == 2


def test_lars_param_groups_leaves_out_empty_groups() -> None:
    groups = lars_param_groups(nn.Linear(3, 4, bias=False))
    assert len(groups) == 1
    assert "lars" not in groups[0]


# --- AMP -----------------------------------------------------------------------------------


def test_fp16_fused_adam_under_grad_scaler_matches_unscaled_float32() -> None:
    """Issue #10: scaled gradients made scale * rate * (g + wd * w) overflow float16."""
    embedding = nn.Embedding(1000, 64).half()
    start = embedding.weight.detach().float().clone()
    optimizer = torch.optim.Adam(embedding.parameters(), lr=1e-3, fused=True)
    GradientLARS(weight_decay=1e-4).attach(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.get_scale()
    scaler.scale(embedding(torch.randint(0, 1000, (256,))).float().square().mean()).backward()
    true_grad = embedding.weight.grad.float() / scale
    scaler.step(optimizer)
    scaler.update()
    assert torch.isfinite(embedding.weight).all()
    assert scaler.get_scale() == scale  # the step was not skipped
    expected = nn.Parameter(start.clone())
    expected.grad = reference(start, true_grad, weight_decay=1e-4)[0].float()
    torch.optim.Adam([expected], lr=1e-3).step()
    torch.testing.assert_close(embedding.weight.detach(), expected.detach().half(), rtol=0, atol=0)


def overflowing_fp16_step(inf_in_grad: bool) -> tuple[nn.Parameter, torch.optim.Optimizer, float]:
    """A fused Adam step whose hooked gradient overflows float16 (rate * g near 1e6)."""
    param = nn.Parameter(torch.ones(4, 4, dtype=torch.float16))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    GradientLARS(trust_coefficient=1e6).attach(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((param.float() * torch.randn(4, 4)).sum()).backward()
    if inf_in_grad:
        param.grad[0, 0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    return param, optimizer, scaler.get_scale()


def test_overflow_in_the_hooked_gradient_skips_the_fused_step() -> None:
    param, optimizer, scale = overflowing_fp16_step(inf_in_grad=False)
    torch.testing.assert_close(param.detach(), torch.ones(4, 4, dtype=torch.float16))
    assert optimizer.state[param]["step"].item() == 0
    assert scale == 1024.0  # the scaled gradients were finite: the scale stays


# --- torch.compile -------------------------------------------------------------------------


def test_hook_traces_without_graph_breaks() -> None:
    """fullgraph=True fails on .item() or Python branches on tensor values: no host sync."""
    torch._dynamo.reset()
    params = [param_with_grad(8, 4), param_with_grad(4), param_with_grad(3, 3, 3)]
    expected = [reference(p, p.grad, weight_decay=1e-3, clip_lr=0.1)[0] for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    hook = GradientLARS(weight_decay=1e-3, clip=True)
    hook.attach(optimizer)
    # The optimizer's own step has a deliberate graph break, so trace the hook alone.
    torch.compile(hook._pre_step, backend="aot_eager", fullgraph=True)(optimizer, (optimizer,), {})
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad.float())


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"threshold": -1.0}, ValueError, r"threshold must be non-negative, got threshold=-1.0"),
        ({"weight_decay": -1e-4}, ValueError, r"weight_decay must be non-negative"),
        ({"eps": -1e-9}, ValueError, r"eps must be non-negative, got eps=-1e-09"),
        ({"trust_coefficient": 0.0}, ValueError, r"trust_coefficient must be positive"),
        ({"trust_coefficient": -1.0}, ValueError, r"trust_coefficient must be positive"),
        ({"clip": 1}, TypeError, r"clip must be a bool, got clip=1"),
        ({"threshold": "1"}, TypeError, r"threshold must be a real number, got threshold='1'"),
        ({"eps": math.nan}, ValueError, r"eps must be finite"),
        (
            {"zero_grad_mode": "none"},
            ValueError,
            r"zero_grad_mode must be one of 'scale', 'decay', 'skip', got zero_grad_mode='none'",
        ),
        ({"zero_grad_mode": True}, TypeError, r"zero_grad_mode must be a str, one of .*=True"),
    ],
    ids=[
        "threshold",
        "weight_decay",
        "eps",
        "trust-zero",
        "trust-negative",
        "clip",
        "str",
        "nan",
        "zero-grad-mode",
        "zero-grad-mode-bool",
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradientLARS(**kwargs)


def test_lars_functional_checks_its_settings() -> None:
    param = param_with_grad(3)
    grad = param.grad.clone()
    with pytest.raises(ValueError, match="weight_decay must be non-negative"):
        lars_([param], weight_decay=-1.0)
    assert torch.equal(param.grad, grad)


@pytest.mark.parametrize(
    ("group", "hook_decay", "warns"),
    [
        ({"weight_decay": 1e-4}, 5e-4, True),
        ({"weight_decay": 1e-4, "lars_weight_decay": 0.0}, 5e-4, False),
        ({"weight_decay": 1e-4, "lars": False}, 5e-4, False),
        ({"weight_decay": 0.0}, 5e-4, False),
        ({"weight_decay": 1e-4}, 0.0, False),
        ({"weight_decay": 0.0, "lars_weight_decay": 1e-3}, 0.0, False),
    ],
    ids=["both", "hook-off-in-group", "group-opts-out", "optimizer-off", "hook-off", "override"],
)
def test_optimizer_decay_under_hook_decay_warns_once(
    group: dict[str, Any], hook_decay: float, warns: bool
) -> None:
    param = param_with_grad(3, 3)
    optimizer = torch.optim.SGD([{"params": [param], **group}], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GradientLARS(weight_decay=hook_decay).attach(optimizer)
        optimizer.step()
        optimizer.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if not warns:
        assert messages == []
        return
    assert len(messages) == 1
    assert messages[0].startswith(
        "param group 0: the optimizer's \"weight_decay\"=0.0001 and GradientLARS's "
        "weight_decay=0.0005 both decay these parameters, so decay would be applied twice"
    )


def test_group_added_later_with_its_own_decay_warns_at_the_next_step() -> None:
    optimizer = torch.optim.SGD([param_with_grad(3, 3)], lr=0.1)
    GradientLARS(weight_decay=1e-3).attach(optimizer)
    optimizer.add_param_group({"params": [param_with_grad(2, 2)], "weight_decay": 1e-2})
    with pytest.warns(UserWarning, match=r"param group 1: the optimizer's \"weight_decay\"=0\.01"):
        optimizer.step()


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [
        ({"lars_threshold": -1.0}, ValueError, r"param group 0: lars_threshold must be non-neg"),
        ({"lars_clip": "yes"}, TypeError, r"param group 0: lars_clip must be a bool"),
        ({"lars_clip": True, "lr": None}, ValueError, r'clip=True divides by .* "lr"=None'),
        (
            {"lars_zero_grad_mode": "Skip"},
            ValueError,
            r"param group 0: lars_zero_grad_mode must be one of 'scale', 'decay', 'skip'",
        ),
    ],
    ids=["threshold", "clip", "clip-without-lr", "zero-grad-mode"],
)
def test_bad_group_values_refused_at_attach(
    group: dict[str, Any], error: type[Exception], match: str
) -> None:
    optimizer = torch.optim.SGD([{"params": mlp().parameters(), **group}], lr=0.1)
    with pytest.raises(error, match=match):
        GradientLARS().attach(optimizer)


def test_lars_param_groups_errors() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        lars_param_groups([])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exclude must be a callable"):
        lars_param_groups(mlp(), exclude=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"by must be 'shape' or 'module', got by='type'"):
        lars_param_groups(mlp(), by="type")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exclude replaces the rule that by='module' names"):
        lars_param_groups(mlp(), exclude=lambda name, p: False, by="module")
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        lars_param_groups([], by="module")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"exclude must return a bool, got builtins\.str for parameter '0\.weight'"
    ):
        lars_param_groups(mlp(), exclude=lambda name, p: name)  # type: ignore[arg-type,return-value]
