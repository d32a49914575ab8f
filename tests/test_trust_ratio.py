"""TrustRatio: the LAMB and optax references, any optimizer's update, settings, its AMP and
precision specifics, its copy of the parameters, errors. What every hook shares is in
test_hook_contract.py."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_close_rel
from hook_kinds import guarded_ratio
from normhooks import GradientLARS, TrustRatio
from normhooks import trust_ratio as trust_ratio_module

SHAPES = [(6, 5), (5,), (3, 6, 2), (3,)]
BETAS = (0.9, 0.99)
ADAM_EPS = 1e-6


def make_params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator, dtype=dtype)) for s in SHAPES]


def make_grads(steps: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> list[list[Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(s, generator=generator, dtype=dtype) for s in SHAPES] for _ in range(steps)
    ]


def lamb_reference(
    start: Sequence[Tensor],
    grads: Sequence[Sequence[Tensor]],
    lrs: Sequence[float],
    weight_decay: float,
    *,
    l2: bool = False,
    adapt: Sequence[bool] | None = None,
    **trust: Any,
) -> tuple[list[Tensor], list[list[float]]]:
    """LAMB written out from arXiv:1904.00962 (Algorithm 2, bias-corrected) in float64.

    ``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` and ``w -= lr * r * u`` with
    ``r = ||w|| / ||u||``: the update timm's Lamb and apex's FusedLAMB (adam_w_mode) compute.
    ``l2=True`` is apex's adam_w_mode=False: the decay enters the gradient instead.
    ``adapt[i]`` False leaves parameter i at r = 1 (timm/apex on groups without decay).
    """
    ws = [w.detach().double().clone() for w in start]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    ratios = []
    for t, (step_grads, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        step_ratios = []
        for i, grad in enumerate(step_grads):
            g = grad.double() + (weight_decay * ws[i] if l2 else 0)
            ms[i] = BETAS[0] * ms[i] + (1 - BETAS[0]) * g
            vs[i] = BETAS[1] * vs[i] + (1 - BETAS[1]) * g * g
            m_hat, v_hat = ms[i] / (1 - BETAS[0] ** t), vs[i] / (1 - BETAS[1] ** t)
            u = m_hat / (v_hat.sqrt() + ADAM_EPS) + (0 if l2 else weight_decay * ws[i])
            ratio = 1.0
            if adapt is None or adapt[i]:
                ratio = guarded_ratio(ws[i].norm().item(), u.norm().item(), **trust)
            ws[i] = ws[i] - lr * ratio * u
            step_ratios.append(ratio)
        ratios.append(step_ratios)
    return ws, ratios


def optax_momentum_reference(
    start: Sequence[Tensor],
    grads: Sequence[Sequence[Tensor]],
    lr: float,
    momentum: float,
    weight_decay: float,
    **trust: Any,
) -> list[Tensor]:
    """optax's chain(add_decayed_weights(wd), trace(momentum), scale_by_trust_ratio(),
    scale(-lr)) written out: t = momentum * t + (g + wd w); w -= lr * r(w, t) * t."""
    ws = [w.detach().double().clone() for w in start]
    traces = [torch.zeros_like(w) for w in ws]
    for step_grads in grads:
        for i, grad in enumerate(step_grads):
            traces[i] = momentum * traces[i] + grad.double() + weight_decay * ws[i]
            ratio = guarded_ratio(ws[i].norm().item(), traces[i].norm().item(), **trust)
            ws[i] = ws[i] - lr * ratio * traces[i]
    return ws


def run_hooked(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    grads: Sequence[Sequence[Tensor]],
    hook: TrustRatio,
    on_step: Callable[[int], None] | None = None,
) -> list[list[Tensor]]:
    """Sets each step's gradients and steps; returns the hook's ratios per step."""
    ratios = []
    for step, step_grads in enumerate(grads):
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.to(param.dtype).clone()
        optimizer.step()
        ratios.append([r.clone() for r in hook.last_ratios])
        if on_step is not None:
            on_step(step)
    return ratios


def tolerance(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-5


# --- references ----------------------------------------------------------------------------

ADAMW_KINDS = {
    "single-tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", list(ADAMW_KINDS))
def test_adamw_matches_lamb_over_a_trajectory(kind: str, dtype: torch.dtype) -> None:
    params, grads = make_params(dtype), make_grads(8)
    expected, expected_ratios = lamb_reference(params, grads, [1e-2] * 8, 0.05)
    optimizer = torch.optim.AdamW(
        params, lr=1e-2, betas=BETAS, eps=ADAM_EPS, weight_decay=0.05, **ADAMW_KINDS[kind]
    )
    hook = TrustRatio()
    hook.attach(optimizer)
    ratios = run_hooked(params, optimizer, grads, hook)
    for got, want in zip(params, expected, strict=True):
        assert_close_rel(got.detach().double(), want, tolerance(dtype))
    # In float32 the ratio comes from w_new - w_old, exact to about ulp(w) / |lr * u|.
    torch.testing.assert_close(
        torch.tensor([r[0].tolist() for r in ratios], dtype=torch.float64),
        torch.tensor(expected_ratios, dtype=torch.float64),
        rtol=1e-12 if dtype == torch.float64 else 1e-4,
        atol=0,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_adam_with_l2_decay_matches_apex_adam_mode(dtype: torch.dtype) -> None:
    """apex FusedLAMB(adam_w_mode=False): the decay enters the moments, not the update."""
    params, grads = make_params(dtype), make_grads(6)
    expected, _ = lamb_reference(params, grads, [1e-2] * 6, 0.05, l2=True)
    optimizer = torch.optim.Adam(params, lr=1e-2, betas=BETAS, eps=ADAM_EPS, weight_decay=0.05)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for got, want in zip(params, expected, strict=True):
        assert_close_rel(got.detach().double(), want, tolerance(dtype))


def test_opting_out_undecayed_groups_matches_timm_and_apex_defaults() -> None:
    """timm's always_adapt=False / apex's use_nvlamb=False: no ratio where weight_decay=0."""
    params, grads = make_params(), make_grads(6)
    decayed, undecayed = [params[0], params[2]], [params[1], params[3]]
    # The reference with per-parameter decay: two runs, one per group's setting.
    want_decayed, _ = lamb_reference(decayed, [[g[0], g[2]] for g in grads], [1e-2] * 6, 0.05)
    want_plain, _ = lamb_reference(
        undecayed, [[g[1], g[3]] for g in grads], [1e-2] * 6, 0.0, adapt=[False, False]
    )
    optimizer = torch.optim.AdamW(
        [{"params": decayed}, {"params": undecayed, "weight_decay": 0.0, "trust": False}],
        lr=1e-2,
        betas=BETAS,
        eps=ADAM_EPS,
        weight_decay=0.05,
    )
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(decayed + undecayed, optimizer, [[g[0], g[2], g[1], g[3]] for g in grads], hook)
    for got, want in zip(decayed + undecayed, want_decayed + want_plain, strict=True):
        assert_close_rel(got.detach(), want, 1e-12)
    assert hook.last_ratios[1].numel() == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_timm_lamb(dtype: torch.dtype) -> None:
    timm_optim = pytest.importorskip("timm.optim")
    params, grads = make_params(dtype), make_grads(8)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    lamb = timm_optim.Lamb(
        twins,
        lr=1e-2,
        betas=BETAS,
        eps=ADAM_EPS,
        weight_decay=0.05,
        max_grad_norm=None,
        always_adapt=True,
    )
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, eps=ADAM_EPS, weight_decay=0.05)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for step_grads in grads:
        for twin, grad in zip(twins, step_grads, strict=True):
            twin.grad = grad.to(dtype)
        lamb.step()
    for got, want in zip(params, twins, strict=True):
        assert_close_rel(got.detach(), want.detach(), tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("eps", [0.0, 0.5], ids=["eps0", "eps-large"])
def test_sgd_momentum_matches_optax_composition(eps: float, dtype: torch.dtype) -> None:
    params, grads = make_params(dtype), make_grads(6)
    expected = optax_momentum_reference(params, grads, 0.1, 0.9, 1e-3, eps=eps)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    hook = TrustRatio(eps=eps)
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for got, want in zip(params, expected, strict=True):
        assert_close_rel(got.detach().double(), want, tolerance(dtype))


def test_lr_scheduler_lr_is_read_at_each_step() -> None:
    params, grads = make_params(), make_grads(5)
    lrs = [1e-2 * 0.5**step for step in range(5)]
    expected, _ = lamb_reference(params, grads, lrs, 0.05)
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, eps=ADAM_EPS, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook, on_step=lambda _: scheduler.step())
    for got, want in zip(params, expected, strict=True):
        assert_close_rel(got.detach(), want, 1e-12)


def test_tensor_lr() -> None:
    params, grads = make_params(), make_grads(3)
    expected, _ = lamb_reference(params, grads, [1e-2] * 3, 0.05)
    optimizer = torch.optim.AdamW(
        params,
        lr=torch.tensor(1e-2, dtype=torch.float64),
        betas=BETAS,
        eps=ADAM_EPS,
        weight_decay=0.05,
    )
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for got, want in zip(params, expected, strict=True):
        assert_close_rel(got.detach(), want, 1e-12)


OTHER_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(OTHER_OPTIMIZERS))
def test_any_optimizer_gets_its_own_update_rescaled(name: str) -> None:
    """Two steps: the hooked result equals the plain optimizer's update times the ratio."""
    make = OTHER_OPTIMIZERS[name]
    params = make_params()
    plain_params = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer, plain = make(params), make(plain_params)
    hook = TrustRatio()
    hook.attach(optimizer)
    for step_grads in make_grads(2):
        # the plain twin starts each step where the hooked one is, with the same state
        with torch.no_grad():
            for twin, param in zip(plain_params, params, strict=True):
                twin.copy_(param)
        plain.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        old = [p.detach().clone() for p in params]
        for param, twin, grad in zip(params, plain_params, step_grads, strict=True):
            param.grad, twin.grad = grad.clone(), grad.clone()
        optimizer.step()
        plain.step()
        lr = optimizer.param_groups[0]["lr"]
        for param, twin, w in zip(params, plain_params, old, strict=True):
            delta = twin.detach() - w
            ratio = guarded_ratio(w.norm().item(), delta.norm().item() / lr)
            assert_close_rel(param.detach(), w + ratio * delta, 1e-12)


def test_third_party_optimizer_subclass() -> None:
    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.sub_(group["lr"] * p.grad.sign())

    params = make_params()
    old = [p.detach().clone() for p in params]
    optimizer = SignSGD(params, lr=0.1)
    hook = TrustRatio()
    hook.attach(optimizer)
    (grads,) = make_grads(1)
    run_hooked(params, optimizer, [grads], hook)
    for param, w, g in zip(params, old, grads, strict=True):
        ratio = w.norm() / g.sign().norm()
        assert_close_rel(param.detach(), w - 0.1 * ratio * g.sign(), 1e-12)


# --- settings: threshold, clip, coefficient, eps, zero norms -------------------------------


@settings(deadline=None, max_examples=60)
@given(
    threshold=st.sampled_from([0.0, 0.5, 2.0, 100.0]),
    eps=st.sampled_from([0.0, 1e-6, 0.3, 5.0]),
    coefficient=st.floats(0.01, 10.0),
    clip=st.one_of(st.none(), st.floats(0.05, 20.0)),
    lr=st.floats(1e-4, 1.0),
    scale=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**16),
)
def test_one_sgd_step_matches_formula(
    threshold: float,
    eps: float,
    coefficient: float,
    clip: float | None,
    lr: float,
    scale: float,
    seed: int,
) -> None:
    params = make_params(seed=seed)
    with torch.no_grad():
        params[0].mul_(scale)
    (grads,) = make_grads(1, seed=seed + 1)
    old = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=lr)
    hook = TrustRatio(threshold, eps, trust_coefficient=coefficient, clip=clip)
    hook.attach(optimizer)
    run_hooked(params, optimizer, [grads], hook)
    trust = {"threshold": threshold, "eps": eps, "trust_coefficient": coefficient, "clip": clip}
    for param, w, g, got_ratio in zip(params, old, grads, hook.last_ratios[0], strict=True):
        ratio = guarded_ratio(w.norm().item(), g.norm().item(), **trust)
        # The update is read back as w_new - w_old, whose rounding (half an ulp of |w| per
        # element) is relative to ||lr * g||: far above 1e-12 when lr * |g| << |w|.
        rounding = w.numel() ** 0.5 * 2.0**-52 * w.abs().max().item()
        cancellation = rounding / (lr * g.norm().item()) if g.norm() > 0 else 0.0
        assert got_ratio.item() == pytest.approx(ratio, rel=1e-12 + 4 * cancellation)
        assert_close_rel(param.detach(), w - lr * ratio * g, 1e-12)


def test_threshold_keeps_small_weights_at_ratio_one() -> None:
    small, large = nn.Parameter(torch.full((4,), 0.1)), nn.Parameter(torch.full((4,), 3.0))
    for p in (small, large):
        p.grad = torch.ones(4)
    optimizer = torch.optim.SGD([small, large], lr=0.1)
    hook = TrustRatio(threshold=1.0)
    hook.attach(optimizer)
    optimizer.step()
    assert hook.last_ratios[0].tolist() == pytest.approx([1.0, 3.0], rel=1e-6)
    torch.testing.assert_close(small.detach(), torch.full((4,), 0.0))
    torch.testing.assert_close(large.detach(), torch.full((4,), 3.0 - 0.1 * 3.0))


def test_clip_caps_the_ratio() -> None:
    param = nn.Parameter(torch.full((4,), 3.0))
    param.grad = torch.ones(4)
    optimizer = torch.optim.SGD([param], lr=0.1)
    hook = TrustRatio(clip=1.0)
    hook.attach(optimizer)
    optimizer.step()
    assert hook.last_ratios[0].tolist() == [1.0]
    torch.testing.assert_close(param.detach(), torch.full((4,), 2.9))


def test_max_weight_norm_caps_the_weight_norm_in_the_ratio() -> None:
    # ||w|| = 6 capped at 2, ||u|| = 2: r = 1, where the uncapped ratio would be 3.
    capped, small = nn.Parameter(torch.full((4,), 3.0)), nn.Parameter(torch.full((4,), 0.5))
    for p in (capped, small):
        p.grad = torch.ones(4)
    optimizer = torch.optim.SGD([capped, small], lr=0.1)
    hook = TrustRatio(max_weight_norm=2.0)
    hook.attach(optimizer)
    optimizer.step()
    assert hook.last_ratios[0].tolist() == pytest.approx([1.0, 0.5], rel=1e-6)
    torch.testing.assert_close(capped.detach(), torch.full((4,), 2.9))


def test_floor_bounds_the_ratio_below_but_not_the_fallback() -> None:
    tiny, zero = nn.Parameter(torch.full((4,), 1e-3)), nn.Parameter(torch.zeros(4))
    for p in (tiny, zero):
        p.grad = torch.ones(4)
    optimizer = torch.optim.SGD([tiny, zero], lr=0.1)
    hook = TrustRatio(floor=0.01)
    hook.attach(optimizer)
    optimizer.step()
    assert hook.last_ratios[0].tolist() == pytest.approx([0.01, 1.0], rel=1e-6)
    torch.testing.assert_close(zero.detach(), torch.full((4,), -0.1))


def uncorrected_adam_reference(
    params: list[nn.Parameter], grads: list[list[Tensor]], lr: float, wd: float
) -> list[Tensor]:
    """``w -= lr * r * u`` with ``u = m / (sqrt(v) + eps) + wd * w``, moments never corrected
    (torch-optimizer's and pytorch-lamb's Lamb), ``r = ||w|| / ||u||`` or 1 at a zero norm."""
    ws = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for step_grads in grads:
        for w, m, v, g in zip(ws, ms, vs, step_grads, strict=True):
            m.mul_(BETAS[0]).add_((1 - BETAS[0]) * g)
            v.mul_(BETAS[1]).add_((1 - BETAS[1]) * g * g)
            u = m / (v.sqrt() + ADAM_EPS) + wd * w
            w_norm, u_norm = w.norm(), u.norm()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            w.sub_(lr * ratio * u)
    return ws


def uncorrected_eps_(optimizer: torch.optim.Optimizer, step: int) -> None:
    """AdamW's eps that puts the uncorrected LAMB's eps on ``sqrt(v)`` (see lamb.md)."""
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS / math.sqrt(1 - BETAS[1] ** step)


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
@pytest.mark.parametrize("wd", [0.0, 0.05], ids=["no-decay", "decay"])
def test_without_bias_correction_adamw_takes_the_uncorrected_lamb_step(
    wd: float, foreach: bool | None
) -> None:
    params, grads = make_params(), make_grads(6)
    with torch.no_grad():
        params[1].zero_()  # a zero weight: the ratio falls back to 1, the uncorrected step
    expected = uncorrected_adam_reference(params, grads, 1e-2, wd)
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, weight_decay=wd)
    TrustRatio(bias_correction=False, foreach=foreach).attach(optimizer)
    for step, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        uncorrected_eps_(optimizer, step)
        optimizer.step()
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.detach(), want, rtol=1e-12, atol=1e-14)


def test_without_bias_correction_in_float32_stays_near_float64() -> None:
    params64, grads = make_params(), make_grads(6)
    params32 = [nn.Parameter(p.detach().float()) for p in params64]
    for params in (params64, params32):
        optimizer = torch.optim.AdamW(params, lr=1e-2, betas=BETAS, weight_decay=0.05)
        TrustRatio(bias_correction=False).attach(optimizer)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.to(p.dtype)
            optimizer.step()
    for p32, p64 in zip(params32, params64, strict=True):
        torch.testing.assert_close(p32.detach().double(), p64.detach(), rtol=0, atol=1e-5)


def test_infinite_threshold_never_takes_the_ratio() -> None:
    param = nn.Parameter(torch.full((4,), 3.0))
    param.grad = torch.ones(4)
    optimizer = torch.optim.SGD([param], lr=0.1)
    hook = TrustRatio(threshold=math.inf)
    hook.attach(optimizer)
    optimizer.step()
    assert hook.last_ratios[0].tolist() == [1.0]
    torch.testing.assert_close(param.detach(), torch.full((4,), 2.9))


def test_bias_correction_group_override_applies_to_its_group_only() -> None:
    corrected, uncorrected = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    for p in (corrected, uncorrected):
        p.grad = torch.ones(3)
    optimizer = torch.optim.Adam(
        [{"params": [corrected]}, {"params": [uncorrected], "trust_bias_correction": False}],
        lr=0.1,
        betas=BETAS,
        eps=0.0,
    )
    TrustRatio().attach(optimizer)
    optimizer.step()
    # Step 1 at a zero weight: Adam's corrected step is lr; the uncorrected one is
    # lr * (1 - beta1) / sqrt(1 - beta2).
    torch.testing.assert_close(corrected.detach(), torch.full((3,), -0.1))
    uncorrected_step = 0.1 * (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])
    torch.testing.assert_close(uncorrected.detach(), torch.full((3,), -uncorrected_step))


@pytest.mark.parametrize("case", ["zero-weight", "zero-update", "zero-lr", "empty"])
def test_zero_norms_give_ratio_one_and_the_optimizers_result(case: str) -> None:
    weight = torch.zeros(3) if case == "zero-weight" else torch.ones(3)
    if case == "empty":
        weight = torch.ones(0)
    param = nn.Parameter(weight.clone())
    param.grad = torch.zeros_like(weight) if case == "zero-update" else torch.ones_like(weight)
    lr = 0.0 if case == "zero-lr" else 0.1
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=0.0)
    twin = nn.Parameter(weight.clone())
    twin.grad = param.grad.clone()
    plain = torch.optim.AdamW([twin], lr=lr, weight_decay=0.0)
    hook = TrustRatio(eps=1e-3)
    hook.attach(optimizer)
    optimizer.step()
    plain.step()
    assert hook.last_ratios[0].tolist() == [1.0]
    assert torch.equal(param.detach(), twin.detach())
    assert torch.isfinite(param).all()


def test_non_finite_update_stays_non_finite() -> None:
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([1.0, math.nan, 1.0])
    optimizer = torch.optim.SGD([param], lr=0.1)
    TrustRatio().attach(optimizer)
    optimizer.step()
    assert torch.isnan(param).any()


def test_group_overrides_of_threshold_and_eps() -> None:
    a, b = nn.Parameter(torch.full((4,), 1.0)), nn.Parameter(torch.full((4,), 1.0))
    for p in (a, b):
        p.grad = torch.ones(4)
    optimizer = torch.optim.SGD(
        [{"params": [a], "trust_threshold": 5.0}, {"params": [b], "trust_eps": 2.0}], lr=0.1
    )
    hook = TrustRatio()
    hook.attach(optimizer)
    optimizer.step()
    assert [r.item() for r in hook.last_ratios] == pytest.approx([1.0, 0.5], rel=1e-6)


# --- the optimizer and its step ------------------------------------------------------------


def test_state_dict_has_no_extra_state() -> None:
    params, grads = make_params(), make_grads(2)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer, plain = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(twins, lr=1e-2)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for step_grads in grads:
        for twin, grad in zip(twins, step_grads, strict=True):
            twin.grad = grad.clone()
        plain.step()
    state, plain_state = optimizer.state_dict(), plain.state_dict()
    assert state["param_groups"] == plain_state["param_groups"]
    assert state["state"].keys() == plain_state["state"].keys()
    for key, value in state["state"].items():
        assert value.keys() == plain_state["state"][key].keys()
    assert hook._pending.get(optimizer) is None  # the copies are released after the step


class LargeAllocations(TorchDispatchMode):
    """Records the size of every tensor allocated with at least ``least`` values."""

    ALLOCATIONS = frozenset(
        {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "new_zeros", "clone"}
    )

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least = least
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ in self.ALLOCATIONS:
            outputs = out if isinstance(out, (list, tuple)) else [out]
            self.sizes += [t.numel() for t in outputs if t.numel() >= self.least]
        return out


def test_the_copy_is_allocated_once_and_kept_between_steps_on_the_cpu() -> None:
    """A fresh copy at every step cost the CPU a page fault per page: glibc hands a block
    that large back to the system when it is freed."""
    params, grads = make_params(), make_grads(3)
    optimizer = torch.optim.SGD(params, lr=0.1)
    hook = TrustRatio()
    hook.attach(optimizer)
    allocated = []
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        old = [p.detach().clone() for p in params]
        with LargeAllocations(least=min(p.numel() for p in params)) as allocations:
            optimizer.step()
        allocated.append(allocations.sizes)
        for param, w, g in zip(params, old, step_grads, strict=True):
            ratio = guarded_ratio(w.norm().item(), g.norm().item())
            assert_close_rel(param.detach(), w - 0.1 * ratio * g, 1e-12)
    assert allocated[0] == [sum(p.numel() for p in params)]  # one flat buffer, at the first step
    assert allocated[1:] == [[], []]


def test_composes_with_gradient_lars() -> None:
    params, (grads,) = make_params(), make_grads(1)
    old = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    GradientLARS(eps=0.0).attach(optimizer)
    TrustRatio().attach(optimizer)
    run_hooked(params, optimizer, [grads], TrustRatio())
    # LARS scales g to ||w|| g / ||g||; the trust ratio of that update is ||w|| / ||w|| = 1.
    for param, w, g in zip(params, old, grads, strict=True):
        assert_close_rel(param.detach(), w - 0.1 * w.norm() * g / g.norm(), 1e-12)


# --- AMP -----------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def overflowing_step(
    fused: bool, bias_correction: bool = True
) -> tuple[nn.Module, list[Tensor], TrustRatio, Any]:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
    hook = TrustRatio(bias_correction=bias_correction)
    hook.attach(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(16, 5)).square().mean()).backward()
    model[0].weight.grad[0, 0] = math.inf
    scaler.step(optimizer)
    scaler.update()
    return model, before, hook, optimizer


def test_skipped_non_fused_step_runs_neither_hook() -> None:
    model, before, hook, optimizer = overflowing_step(fused=False)
    assert hook.last_ratios == []  # the post-hook never ran
    assert hook._pending.get(optimizer) is None  # nor did the pre-hook
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)


@pytest.mark.parametrize("bias_correction", [True, False], ids=["corrected", "uncorrected"])
def test_skipped_fused_step_changes_nothing(bias_correction: bool) -> None:
    # Uncorrected, the skipped step is at t = 0, whose correction 0 / 0 must not be read.
    model, before, hook, optimizer = overflowing_step(fused=True, bias_correction=bias_correction)
    assert [r.tolist() for r in hook.last_ratios] == [[1.0] * 4]
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)
        assert optimizer.state[param]["step"].item() == 0


def test_bf16_autocast_with_float32_parameters() -> None:
    """Mixed precision the supported way: float32 parameters, bf16 compute."""
    model = mlp()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 5)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, betas=BETAS, eps=ADAM_EPS, weight_decay=0.05
    )
    hook = TrustRatio()
    hook.attach(optimizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    expected, _ = lamb_reference(list(twin.parameters()), [grads], [1e-2], 0.05)
    for got, want in zip(model.parameters(), expected, strict=True):
        assert_close_rel(got.detach().double(), want, 1e-5)


# --- precision -----------------------------------------------------------------------------


def ulps_of_max(actual: Tensor, truth: Tensor) -> float:
    """|actual - truth| in units in the last place of max |truth| in actual's dtype."""
    largest = truth.abs().max().to(actual.dtype)
    ulp = torch.nextafter(largest, torch.tensor(math.inf, dtype=actual.dtype)) - largest
    return ((actual.double() - truth).abs().max() / ulp.double()).item()


@pytest.mark.parametrize("scale", [0.02, 1.0, 30.0], ids=["r~0.02", "r~1", "r~30"])
@pytest.mark.parametrize("lr", [1e-2, 1e-4])
def test_float32_step_within_ratio_plus_one_ulps_of_float64(scale: float, lr: float) -> None:
    """The difference w_new - w_old carries the optimizer's rounding, which r multiplies."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(64, 32), (256,), (32, 64, 3)]
    params = [nn.Parameter(scale * torch.randn(s, generator=generator)) for s in shapes]
    grads = [torch.randn(s, generator=generator) for s in shapes]
    expected, ratios = lamb_reference(params, [grads], [lr], 1e-2)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=ADAM_EPS, weight_decay=1e-2)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, [grads], hook)
    for param, want, ratio in zip(params, expected, ratios[0], strict=True):
        assert ulps_of_max(param.detach(), want) <= ratio + 1


def test_float32_trajectory_drift_from_float64() -> None:
    """Twenty steps: the drift is at most the sum of the per-step bounds."""
    generator = torch.Generator().manual_seed(4)
    shapes = [(64, 32), (256,)]
    params = [nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(20)]
    expected, ratios = lamb_reference(params, grads, [1e-3] * 20, 1e-2)
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=BETAS, eps=ADAM_EPS, weight_decay=1e-2)
    hook = TrustRatio()
    hook.attach(optimizer)
    run_hooked(params, optimizer, grads, hook)
    for i, (param, want) in enumerate(zip(params, expected, strict=True)):
        assert ulps_of_max(param.detach(), want) <= sum(r[i] + 1 for r in ratios)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"threshold": -1.0},
            ValueError,
            r"threshold must be non-negative or math\.inf, got threshold=-1.0",
        ),
        ({"eps": -1e-9}, ValueError, r"eps must be non-negative, got eps=-1e-09"),
        ({"eps": math.nan}, ValueError, r"eps must be finite, got eps=nan"),
        ({"trust_coefficient": 0.0}, ValueError, r"trust_coefficient must be positive"),
        ({"clip": 0.0}, ValueError, r"clip must be positive, got clip=0.0"),
        ({"clip": True}, TypeError, r"clip must be a real number, got clip=True"),
        ({"threshold": "1"}, TypeError, r"threshold must be a real number, got threshold='1'"),
        (
            {"threshold": -math.inf},
            ValueError,
            r"threshold must be non-negative or math\.inf, got threshold=-inf",
        ),
        ({"floor": 0.0}, ValueError, r"floor must be positive, got floor=0.0"),
        ({"floor": 2.0, "clip": 1.0}, ValueError, r"floor must be at most clip, got floor=2.0"),
        ({"max_weight_norm": 0.0}, ValueError, r"max_weight_norm must be positive"),
        ({"bias_correction": 0}, TypeError, r"bias_correction must be a bool, got bias"),
    ],
    ids=[
        "threshold",
        "eps",
        "eps-nan",
        "coefficient",
        "clip",
        "clip-bool",
        "str",
        "threshold-minus-inf",
        "floor",
        "floor-above-clip",
        "max-weight-norm",
        "bias-correction",
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        TrustRatio(**kwargs)


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [
        ({"trust_eps": -1.0}, ValueError, r"param group 0: trust_eps must be non-negative"),
        ({"trust_clip": 0.0}, ValueError, r"param group 0: trust_clip must be positive"),
        ({"trust_coefficient": -1.0}, ValueError, r"trust_coefficient must be positive"),
        ({"lr": None}, ValueError, r'learning rate, .* but the group has "lr"=None'),
        ({"lr": -0.1}, ValueError, r'but the group has "lr"=-0.1'),
        (
            {"trust_floor": 0.5, "trust_clip": 0.1},
            ValueError,
            r"param group 0: trust_floor must be at most trust_clip",
        ),
        (
            {"trust_bias_correction": False},
            ValueError,
            r"param group 0: bias_correction=False undoes the bias correction of torch.optim."
            r"Adam or AdamW, .* but the optimizer is SGD",
        ),
    ],
    ids=["eps", "clip", "coefficient", "lr-none", "lr-negative", "floor-above-clip", "not-adam"],
)
def test_bad_groups_refused_at_attach(
    group: dict[str, Any], error: type[Exception], match: str
) -> None:
    optimizer = torch.optim.SGD(make_params(), lr=0.1)
    optimizer.param_groups[0].update(group)
    with pytest.raises(error, match=match):
        TrustRatio().attach(optimizer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_parameters_refused(dtype: torch.dtype) -> None:
    optimizer = torch.optim.AdamW(
        [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=dtype))]
    )
    with pytest.raises(
        TypeError, match=rf"parameter 1 of param group 0 is {dtype}; TrustRatio needs"
    ):
        TrustRatio().attach(optimizer)


def test_half_precision_group_may_opt_out() -> None:
    low = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([{"params": [low], "trust": False}], lr=0.1)
    TrustRatio().attach(optimizer)
    low.grad = torch.ones(2, dtype=torch.bfloat16)
    optimizer.step()
    assert torch.equal(low.detach(), torch.full((2,), 0.9, dtype=torch.bfloat16))


def test_bad_group_added_later_refused_before_the_closure_and_nothing_changes() -> None:
    params = make_params()
    optimizer = torch.optim.SGD(params, lr=0.1)
    TrustRatio().attach(optimizer)
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    before = [p.detach().clone() for p in params]
    calls = []

    def closure() -> Tensor:
        calls.append(1)
        return torch.zeros(())

    with pytest.raises(TypeError, match=r"parameter 0 of param group 1 is torch\.float16"):
        optimizer.step(closure)
    assert calls == []
    for param, old in zip(params, before, strict=True):
        assert torch.equal(param.detach(), old)


# --- the CPU order: copies laid out in rows, their norms over the whole buffer ----------------

IN_ROWS_SIZES = {
    "short": [3, 4096],
    "rows-and-tail": [4097, 3 * 1024 + 5],
    "long": [1 << 17, (1 << 18) + 1, 2048],
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("sizes", list(IN_ROWS_SIZES.values()), ids=list(IN_ROWS_SIZES))
def test_norms_and_reverts_match_float64(sizes: list[int], layout: str) -> None:
    torch.manual_seed(0)
    olds = [torch.randn(2, n) for n in sizes]
    news = [o + 1e-3 * torch.randn_like(o) for o in olds]
    if layout == "transposed":
        news = [n.t().contiguous().t() for n in news]
    want_w = [o.double().norm().item() for o in olds]
    reverts = [o - n for o, n in zip(olds, news, strict=True)]  # the float32 difference
    want_d = [r.double().norm().item() for r in reverts]
    w_norm, d_norm = trust_ratio_module.norms_and_reverts_(olds, news)
    torch.testing.assert_close(
        w_norm.double(), torch.tensor(want_w, dtype=torch.float64), rtol=6e-7, atol=0
    )
    torch.testing.assert_close(
        d_norm.double(), torch.tensor(want_d, dtype=torch.float64), rtol=6e-7, atol=0
    )
    for old, revert in zip(olds, reverts, strict=True):
        assert torch.equal(old, revert)


def test_norms_and_reverts_of_no_tensor_are_empty() -> None:
    w_norm, d_norm = trust_ratio_module.norms_and_reverts_([], [])
    assert w_norm.shape == d_norm.shape == (0,)


def test_the_cpu_order_gives_the_base_order_ratios() -> None:
    """The same ratios and parameters as the base's post-step (taken with foreach=False)."""
    torch.manual_seed(0)
    shapes = [(3,), (70, 70), ((1 << 18) + 7,)]
    results = []
    for foreach in (None, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        hook = TrustRatio(foreach=foreach)
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, foreach=True)
        hook.attach(optimizer)
        optimizer.step()
        results.append((hook.last_ratios[0], [p.detach() for p in params]))
    (ratios, params), (base_ratios, base_params) = results
    torch.testing.assert_close(ratios, base_ratios, rtol=1e-6, atol=0)
    for param, base in zip(params, base_params, strict=True):
        torch.testing.assert_close(param, base, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["corrected", "uncorrected"])
def test_the_cpu_order_over_rows_and_tails_gives_the_base_order_ratios(
    layout: str, bias_correction: bool
) -> None:
    """Tensors shorter than a row, of whole rows, ending in a tail, or laid out otherwise than
    their copy, in one buffer of rows."""
    shapes = [(3,), (70, 70), (5 * 1024 + 7,), (2048,), (90, 80)]
    results = []
    for foreach in (None, False):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
        if layout == "transposed":
            params[-1] = nn.Parameter(torch.randn(80, 90).t())
        for p in params:
            p.grad = torch.randn_like(p)
        hook = TrustRatio(foreach=foreach, bias_correction=bias_correction, eps=1e-3)
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, foreach=True)
        hook.attach(optimizer)
        for _ in range(2):
            optimizer.step()
        results.append((hook.last_ratios[0], [p.detach() for p in params]))
    (ratios, params), (base_ratios, base_params) = results
    torch.testing.assert_close(ratios, base_ratios, rtol=1e-6, atol=0)
    for param, base in zip(params, base_params, strict=True):
        torch.testing.assert_close(param, base, rtol=1e-6, atol=1e-7)
