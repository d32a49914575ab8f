"""GradientLARS, lars_ and lars_param_groups: formula, optimizers, AMP, compile, errors."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers import assert_compiled_training_matches_eager, assert_grad_scaler_matches_unscaled
from normhooks import GradientLARS, apply_weight_norm, lars_, lars_param_groups


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
    w64, g64 = w.double(), g.double()
    w_norm, g_norm = w64.norm().item(), g64.norm().item()
    rate = 1.0
    if w_norm > threshold:
        rate = trust_coefficient * w_norm / (eps + g_norm + weight_decay * w_norm)
        if clip_lr is not None:
            rate = min(rate / clip_lr, 1.0)
    return rate * (g64 + weight_decay * w64), rate


def param_with_grad(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    param = nn.Parameter(torch.randn(shape, dtype=dtype))
    param.grad = torch.randn(shape, dtype=dtype)
    return param


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def grads_of(model: nn.Module, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 5, generator=generator)
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int = 3,
    scale_grads: Callable[[], None] | None = None,
) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(16, 5, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        if scale_grads is not None:
            scale_grads()
        optimizer.step()


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


def test_returns_rates_in_parameter_order_across_dtypes() -> None:
    params = [
        param_with_grad(3, 3, dtype=torch.float64),
        param_with_grad(4, dtype=torch.float32),
        nn.Parameter(torch.randn(2)),
        param_with_grad(2, 5, dtype=torch.float64),
    ]
    expected = [reference(p, p.grad)[1] for p in params if p.grad is not None]
    rates = lars_(params)
    assert rates.dtype == torch.float64
    torch.testing.assert_close(
        rates, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0
    )


def test_rates_stay_on_the_first_parameters_device() -> None:
    # meta stands in for an accelerator: a CPU parameter beside it must not pull the rates to
    # the host (reading meta rates back would fail, as reading GPU rates would synchronize).
    params = [nn.Parameter(torch.ones(3, 3, device="meta")), param_with_grad(2, 2)]
    params[0].grad = torch.ones(3, 3, device="meta")
    assert lars_(params).device.type == "meta"


def test_single_tensor_and_generator_inputs() -> None:
    param = param_with_grad(3, 2)
    expected, rate = reference(param, param.grad)
    rates = lars_(param)
    torch.testing.assert_close(rates, torch.tensor([rate], dtype=torch.float32))
    torch.testing.assert_close(param.grad, expected.float())
    other = param_with_grad(2)
    assert lars_(p for p in [other]).shape == (1,)


def test_parameters_without_grad_are_skipped() -> None:
    with_grad, without = param_with_grad(3), nn.Parameter(torch.randn(3))
    assert lars_([without, with_grad]).shape == (1,)
    assert without.grad is None
    assert lars_([without]).shape == (0,)


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


@pytest.mark.parametrize("foreach", [None, True, False], ids=["auto", "foreach", "per-tensor"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"]
)
def test_foreach_modes_match_formula(foreach: bool | None, dtype: torch.dtype) -> None:
    # 200 x 200 is above the size the CPU path takes as one dot product.
    params = [param_with_grad(200, 200), param_with_grad(7, 3), param_with_grad(5)]
    params = [nn.Parameter(p.detach().to(dtype)) for p in params]
    for param in params:
        param.grad = torch.randn(param.shape).to(dtype)
    expected = [reference(p, p.grad, weight_decay=1e-2) for p in params]
    rates = lars_(params, weight_decay=1e-2, foreach=foreach)
    rtol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6}[dtype]
    torch.testing.assert_close(
        rates.double(),
        torch.tensor([r for _, r in expected], dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )
    for param, (grad, _) in zip(params, expected, strict=True):
        if dtype == torch.bfloat16:  # within one rounding of the float32 computation
            torch.testing.assert_close(param.grad.double(), grad, rtol=2**-7, atol=1e-6)
        else:
            torch.testing.assert_close(param.grad.double(), grad, rtol=rtol, atol=rtol * 1e-3)


def test_per_tensor_fallback_under_grad_scaler_matches_unscaled() -> None:
    def make(fused: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        def build(m: nn.Module) -> torch.optim.Optimizer:
            optimizer = torch.optim.Adam(lars_param_groups(m), lr=1e-2, fused=fused)
            GradientLARS(weight_decay=1e-2, foreach=False).attach(optimizer)
            return optimizer

        return build

    assert_grad_scaler_matches_unscaled(
        mlp(), torch.randn(16, 5), make(True), make(False), rtol=1e-5, atol=1e-6
    )


# --- the hook on optimizers ----------------------------------------------------------------


def hooked_grads_reference(model: nn.Module, **lars: Any) -> Callable[[], None]:
    """A callable that applies the formula to the model's current grads by hand."""

    def apply() -> None:
        with torch.no_grad():
            for param in model.parameters():
                grad, _ = reference(param, param.grad, **lars)
                param.grad.copy_(grad)

    return apply


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        lambda p: torch.optim.RMSprop(p, lr=1e-2),
        lambda p: torch.optim.Adagrad(p, lr=1e-2),
    ],
    ids=["sgd", "sgd-nesterov-loop", "adamw", "rmsprop", "adagrad"],
)
# AdamW's default weight_decay=1e-2 decays on top of the hook's, which the hook warns about.
@pytest.mark.filterwarnings("ignore:param group 0.*both decay:UserWarning")
def test_composes_with_optimizers(make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
    model = mlp()
    manual = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    GradientLARS(weight_decay=1e-3).attach(optimizer)
    train(model, optimizer)
    manual_optimizer = make_optimizer(manual.parameters())
    train(manual, manual_optimizer, scale_grads=hooked_grads_reference(manual, weight_decay=1e-3))
    for hooked, expected in zip(model.parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(hooked, expected, rtol=1e-5, atol=1e-6)


class PlainSGD(torch.optim.Optimizer):
    """An optimizer from "another library": a minimal subclass."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        return loss


def test_works_with_third_party_optimizer_subclass() -> None:
    model, manual = mlp(), None
    manual = copy.deepcopy(model)
    optimizer = PlainSGD(model.parameters(), lr=0.05)
    GradientLARS().attach(optimizer)
    train(model, optimizer)
    train(
        manual, PlainSGD(manual.parameters(), lr=0.05), scale_grads=hooked_grads_reference(manual)
    )
    for hooked, expected in zip(model.parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(hooked, expected)


def test_handle_remove_restores_plain_behaviour() -> None:
    model = mlp()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    GradientLARS().attach(optimizer).remove()
    train(model, optimizer)
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reattach_after_remove_is_allowed() -> None:
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    hook = GradientLARS()
    hook.attach(optimizer).remove()
    hook.attach(optimizer).remove()


def test_one_hook_on_two_optimizers() -> None:
    hook = GradientLARS()
    first = torch.optim.SGD(mlp().parameters(), lr=0.1)
    second = torch.optim.SGD(mlp().parameters(), lr=0.1)
    hook.attach(first)
    hook.attach(second)


def test_last_rates_per_group() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=0.1)
    hook = GradientLARS()
    assert hook.last_rates == []
    hook.attach(optimizer)
    grads = grads_of(model)
    expected = [
        reference(p, g)[1] for p, g in zip(model.parameters(), grads, strict=True) if p.ndim == 2
    ]
    optimizer.step()
    assert len(hook.last_rates) == 2
    torch.testing.assert_close(hook.last_rates[0].double(), torch.tensor(expected).double())
    assert hook.last_rates[1].shape == (0,)


def test_group_opt_out_and_overrides() -> None:
    first, second, third = param_with_grad(4, 4), param_with_grad(3, 3), param_with_grad(2, 2)
    originals = [p.grad.clone() for p in (first, second, third)]
    optimizer = torch.optim.SGD(
        [
            {"params": [first]},
            {"params": [second], "lars_weight_decay": 0.5, "lars_trust_coefficient": 0.1},
            {"params": [third], "lars": False},
        ],
        lr=0.0,
    )
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(
        lambda *_: seen.extend(p.grad.clone() for p in (first, second, third))
    )
    GradientLARS(weight_decay=1e-3).attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(
        seen[0], reference(first, originals[0], weight_decay=1e-3)[0].float()
    )
    torch.testing.assert_close(
        seen[1],
        reference(second, originals[1], weight_decay=0.5, trust_coefficient=0.1)[0].float(),
    )
    torch.testing.assert_close(seen[2], originals[2], rtol=0, atol=0)


def test_group_override_of_clip() -> None:
    param = param_with_grad(5, 5, dtype=torch.float64)
    expected, _ = reference(param, param.grad, clip_lr=100.0)
    optimizer = torch.optim.SGD([{"params": [param], "lars_clip": True}], lr=100.0)
    seen: list[torch.Tensor] = []
    optimizer.register_step_post_hook(lambda *_: seen.append(param.grad.clone()))
    GradientLARS().attach(optimizer)
    optimizer.step()
    torch.testing.assert_close(seen[0], expected)


def test_param_group_added_after_attach_is_scaled() -> None:
    first, later = param_with_grad(3, 3), param_with_grad(4, 4)
    expected, _ = reference(later, later.grad)
    optimizer = torch.optim.SGD([first], lr=0.0)
    GradientLARS().attach(optimizer)
    optimizer.add_param_group({"params": [later]})
    optimizer.step()
    torch.testing.assert_close(later.grad, expected.float())


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


def test_lars_param_groups_leaves_out_empty_groups() -> None:
    groups = lars_param_groups(nn.Linear(3, 4, bias=False))
    assert len(groups) == 1
    assert "lars" not in groups[0]


def test_optimizer_state_dict_round_trip_unchanged() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(lars_param_groups(model), lr=0.1, momentum=0.9)
    plain_keys = copy.deepcopy(torch.optim.SGD(lars_param_groups(model), lr=0.1).state_dict())
    GradientLARS().attach(optimizer)
    train(model, optimizer, steps=2)
    state = copy.deepcopy(optimizer.state_dict())
    assert [sorted(g) for g in state["param_groups"]] == [
        sorted(g) for g in plain_keys["param_groups"]
    ]
    resumed_model = copy.deepcopy(model)
    resumed = torch.optim.SGD(lars_param_groups(resumed_model), lr=0.1, momentum=0.9)
    resumed.load_state_dict(state)
    GradientLARS().attach(resumed)
    train(model, optimizer, steps=2)
    train(resumed_model, resumed, steps=2)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lr_scheduler_still_drives_the_optimizer() -> None:
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    GradientLARS().attach(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


# --- closure -------------------------------------------------------------------------------


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
def test_step_with_closure_matches_grads_first(positional: bool) -> None:
    model = mlp()
    closure_model = copy.deepcopy(model)
    x = torch.randn(16, 5)

    def loss_fn(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    GradientLARS(weight_decay=1e-3).attach(optimizer)
    closure_optimizer = torch.optim.SGD(closure_model.parameters(), lr=0.1, momentum=0.9)
    GradientLARS(weight_decay=1e-3).attach(closure_optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        expected_loss = loss_fn(model)
        expected_loss.backward()
        optimizer.step()

        def closure() -> torch.Tensor:
            closure_optimizer.zero_grad()
            loss = loss_fn(closure_model)
            loss.backward()
            return loss

        with torch.no_grad():  # the hook must enable grad for the closure itself
            loss = (
                closure_optimizer.step(closure)
                if positional
                else closure_optimizer.step(closure=closure)
            )
        torch.testing.assert_close(loss, expected_loss)
    for a, b in zip(model.parameters(), closure_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class TwiceClosureSGD(PlainSGD):
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        assert closure is not None
        with torch.enable_grad():
            closure()
            return closure()


def test_optimizer_calling_closure_twice_gets_clear_error() -> None:
    model = mlp()
    optimizer = TwiceClosureSGD(model.parameters(), lr=0.1)
    GradientLARS().attach(optimizer)

    def closure() -> torch.Tensor:
        loss = model(torch.ones(2, 5)).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="TwiceClosureSGD called its closure more than once"):
        optimizer.step(closure)


# --- AMP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_grad_scaler_gives_unscaled_result(fused: bool) -> None:
    def make(fused: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        def build(m: nn.Module) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused)
            GradientLARS(weight_decay=1e-2).attach(optimizer)
            return optimizer

        return build

    assert_grad_scaler_matches_unscaled(
        mlp(), torch.randn(16, 5), make(fused), make(False), rtol=1e-6, atol=1e-7
    )


def test_fused_amp_path_keeps_small_half_precision_gradients() -> None:
    """True gradients below float16's range are unscaled in float32, not in the grad's dtype."""
    param = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float16))
    scale = torch.tensor(65536.0)
    true_grad = torch.full((3,), 2e-8)  # below float16's smallest subnormal, 6e-8
    param.grad = (true_grad * scale).to(torch.float16)
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.grad_scale = scale  # what GradScaler sets for a fused optimizer
    hook = GradientLARS(weight_decay=1e-3)
    hook.attach(optimizer)
    expected, _ = reference(param.float(), param.grad.float() / scale, weight_decay=1e-3)
    hook._pre_step(optimizer, (optimizer,), {})
    assert optimizer.grad_scale is None
    torch.testing.assert_close(param.grad, expected.to(torch.float16), rtol=0, atol=0)


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


@pytest.mark.parametrize(
    "optimizer_class",
    [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD],
    ids=["adam", "adamw", "sgd"],
)
def test_fused_optimizers_under_grad_scaler_match_unscaled(
    optimizer_class: type[torch.optim.Optimizer],
) -> None:
    """Both groups, the scaled one and the one the hook skips, must reach the step unscaled."""

    def make(fused: bool) -> Callable[[nn.Module], torch.optim.Optimizer]:
        def build(m: nn.Module) -> torch.optim.Optimizer:
            groups = lars_param_groups(m)
            optimizer = optimizer_class(groups, lr=1e-2, weight_decay=0.0, fused=fused)
            GradientLARS(weight_decay=1e-2).attach(optimizer)
            return optimizer

        return build

    assert_grad_scaler_matches_unscaled(
        mlp(), torch.randn(16, 5), make(True), make(False), rtol=1e-5, atol=1e-6
    )


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


def test_overflow_in_both_skips_once() -> None:
    """found_inf is raised with a max: 2 would make fused Adam's step count -1."""
    param, optimizer, scale = overflowing_fp16_step(inf_in_grad=True)
    torch.testing.assert_close(param.detach(), torch.ones(4, 4, dtype=torch.float16))
    assert optimizer.state[param]["step"].item() == 0
    assert scale == 512.0


def test_deprecated_grad_scaler_kwarg_is_refused() -> None:
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    GradientLARS().attach(optimizer)
    with pytest.raises(RuntimeError, match="grad_scaler argument"):
        optimizer.step(grad_scaler=object())


def test_bf16_model_trains_like_float32_within_rounding() -> None:
    model = mlp()
    low = copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    low_optimizer = torch.optim.SGD(low.parameters(), lr=0.1)
    GradientLARS(weight_decay=1e-3).attach(optimizer)
    hook = GradientLARS(weight_decay=1e-3)
    hook.attach(low_optimizer)
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        param.grad = torch.randn_like(param)
        low_param.grad = param.grad.to(torch.bfloat16)
        with torch.no_grad():
            param.copy_(low_param.float())
    optimizer.step()
    low_optimizer.step()
    assert hook.last_rates[0].dtype == torch.float32
    for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
        torch.testing.assert_close(low_param.float(), param, rtol=1.6e-2, atol=1e-2)


# --- torch.compile -------------------------------------------------------------------------


def test_compiled_training_step_matches_eager() -> None:
    def make(m: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(lars_param_groups(m), lr=0.1, momentum=0.9)
        GradientLARS(weight_decay=1e-3).attach(optimizer)
        return optimizer

    assert_compiled_training_matches_eager(mlp(), torch.randn(16, 5), make, rtol=1e-5, atol=1e-6)


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


def test_functional_traces_without_graph_breaks() -> None:
    torch._dynamo.reset()
    params = [param_with_grad(8, 4), param_with_grad(4)]
    expected = [reference(p, p.grad, weight_decay=1e-3)[0] for p in params]
    torch.compile(lars_, backend="aot_eager", fullgraph=True)(params, weight_decay=1e-3)
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
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradientLARS(**kwargs)


def test_foreach_must_be_bool_or_none() -> None:
    with pytest.raises(TypeError, match="foreach must be a bool or None, got foreach='yes'"):
        GradientLARS(foreach="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="foreach must be a bool or None, got foreach=1"):
        lars_([param_with_grad(3)], foreach=1)  # type: ignore[arg-type]


def test_lars_functional_checks_arguments() -> None:
    param = param_with_grad(3)
    with pytest.raises(ValueError, match="weight_decay must be non-negative"):
        lars_([param], weight_decay=-1.0)
    with pytest.raises(TypeError, match="parameters must be a tensor or an iterable"):
        lars_(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parameters\[0\] must be a torch.Tensor, got str"):
        lars_(["w"])  # type: ignore[list-item]


def test_attach_to_non_optimizer() -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got list"):
        GradientLARS().attach([])  # type: ignore[arg-type]


def test_attach_to_lbfgs() -> None:
    optimizer = torch.optim.LBFGS(mlp().parameters())
    with pytest.raises(TypeError, match="cannot be attached to LBFGS"):
        GradientLARS().attach(optimizer)


def test_attach_twice() -> None:
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    hook = GradientLARS()
    hook.attach(optimizer)
    with pytest.raises(RuntimeError, match="already attached to this SGD"):
        hook.attach(optimizer)


def test_second_instance_on_one_optimizer_refused() -> None:
    """Issue #10: two GradientLARS on one optimizer would scale every gradient twice."""
    param = param_with_grad(4, 4)
    expected, _ = reference(param, param.grad)
    optimizer = torch.optim.SGD([param], lr=0.0)
    first = GradientLARS().attach(optimizer)
    with pytest.raises(
        RuntimeError,
        match=r"another GradientLARS \(GradientLARS\(threshold=0\.01.*\) is already attached "
        r"to this SGD; two would apply LARS twice\. Remove the first one",
    ):
        GradientLARS(weight_decay=1e-3).attach(optimizer)
    optimizer.step()  # scaled once: the refused hook registered nothing
    torch.testing.assert_close(param.grad, expected.float())
    first.remove()
    GradientLARS().attach(optimizer)


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


def test_complex_parameter_refused_at_attach() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.randn(3, dtype=torch.complex64))], lr=0.1)
    with pytest.raises(TypeError, match="parameter 0 of param group 0 must be a real floating"):
        GradientLARS().attach(optimizer)


def test_complex_parameter_refused_by_functional() -> None:
    param = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    param.grad = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"parameters\[0\] must be a real floating.*complex"):
        lars_([param])


def test_sparse_gradient_refused_and_nothing_changed() -> None:
    dense = param_with_grad(4, 4)
    embedding = nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    optimizer = torch.optim.SGD([dense, embedding.weight], lr=0.1)
    GradientLARS().attach(optimizer)
    before = dense.grad.clone()
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 has a torch\.sparse_coo"):
        optimizer.step()
    torch.testing.assert_close(dense.grad, before, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"parameters\[0\] has a torch.sparse_coo gradient"):
        lars_([embedding.weight])


def test_sparse_gradient_in_a_later_group_changes_nothing() -> None:
    """Issue #10: the error names the fix, and no gradient, parameter or state changes."""
    dense = param_with_grad(4, 4)
    embedding = nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.Adam([{"params": [dense]}, {"params": [embedding.weight]}], lr=0.1)
    GradientLARS().attach(optimizer)
    embedding.weight.grad = None
    optimizer.step()  # state for the dense parameter
    state = copy.deepcopy(optimizer.state_dict())
    embedding(torch.tensor([1, 2])).sum().backward()
    before = [t.detach().clone() for t in (dense, dense.grad, embedding.weight)]
    with pytest.raises(
        ValueError,
        match=r"parameter 0 of param group 1 has a torch\.sparse_coo gradient; LARS needs dense "
        r"gradients \(use sparse=False in nn\.Embedding / nn\.EmbeddingBag\)\. No gradient "
        "or parameter was changed",
    ):
        optimizer.step()
    for tensor, old in zip((dense, dense.grad, embedding.weight), before, strict=True):
        torch.testing.assert_close(tensor.detach(), old, rtol=0, atol=0)
    assert str(optimizer.state_dict()) == str(state)


def test_unknown_group_key_refused_at_attach() -> None:
    optimizer = torch.optim.SGD([{"params": mlp().parameters(), "lars_weight_decy": 1e-4}], lr=0.1)
    with pytest.raises(ValueError, match="param group 0: unknown key 'lars_weight_decy'"):
        GradientLARS().attach(optimizer)


def test_duplicate_tensor_refused() -> None:
    param = param_with_grad(3, 3)
    before = param.grad.clone()
    with pytest.raises(ValueError, match=r"parameters\[1\] is the same tensor as parameters\[0\]"):
        lars_([param, param])
    torch.testing.assert_close(param.grad, before, rtol=0, atol=0)


def test_duplicate_tensor_named_by_its_place_in_the_optimizer() -> None:
    unused, param = nn.Parameter(torch.ones(2)), param_with_grad(3, 3)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.SGD([unused, param, param], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"parameter 2 of param group 0 is the same tensor as parameter 1 of param group 0",
    ):
        GradientLARS().attach(optimizer)


def test_bad_group_refused_before_the_closure_runs() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    GradientLARS().attach(optimizer)
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))], "lars_eps": -1.0})
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        return model(torch.ones(1, 5)).sum()

    with pytest.raises(ValueError, match="param group 1: lars_eps must be non-negative"):
        optimizer.step(closure)
    assert calls == []


def test_unknown_group_key_added_later_refused_before_any_change() -> None:
    first = param_with_grad(3, 3)
    before = first.grad.clone()
    optimizer = torch.optim.SGD([first], lr=0.1)
    GradientLARS().attach(optimizer)
    optimizer.add_param_group({"params": [param_with_grad(2, 2)], "lars_trust": 0.1})
    with pytest.raises(ValueError, match="param group 1: unknown key 'lars_trust'"):
        optimizer.step()
    torch.testing.assert_close(first.grad, before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [
        ({"lars_eps": -1.0}, ValueError, r"param group 0: lars_eps must be non-negative"),
        ({"lars": "no"}, TypeError, r"param group 0: \"lars\" must be a bool, got \"lars\"='no'"),
        ({"lars_clip": "yes"}, TypeError, r"param group 0: lars_clip must be a bool"),
    ],
    ids=["eps", "lars-flag", "clip"],
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
    with pytest.raises(
        TypeError, match=r"exclude must return a bool, got builtins\.str for parameter '0\.weight'"
    ):
        lars_param_groups(mlp(), exclude=lambda name, p: name)  # type: ignore[arg-type,return-value]
