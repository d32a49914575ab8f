"""UpdateRMS: Adafactor's update clipping and Moonlight's RMS matching against the formulas in
float64 over many steps of torch's optimizers and pytorch-optimizer's Muon, against
pytorch-optimizer's AdaFactor, its rules, groups, zero updates, AMP, errors. What every hook
shares is in test_hook_contract.py; FSDP2 (an RMS over the whole tensor) in
test_distributed.py, through tests/hook_kinds.py."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from helpers import assert_close_rel
from hook_kinds import rms_ratio
from normhooks import UpdateRMS
from normhooks.update_rms import rms_ratios

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}
RULES = pytest.mark.parametrize(
    ("rule", "rms"), [("clip", 0.5), ("match", 0.2)], ids=["clip", "match"]
)


def model(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def backward(net: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 5, generator=generator, dtype=torch.float64)
    scale = 10.0 if step % 3 == 0 else 1.0  # some steps' updates are clipped, others not
    (scale * net(x.to(next(net.parameters()).dtype)).square().mean()).backward()


def twin_trajectory(
    make: Callable[[Any], torch.optim.Optimizer], steps: int, **rule: Any
) -> tuple[list[Tensor], list[Tensor], list[list[float]], list[list[float]]]:
    """The hooked optimizer's parameters and factors, and the formula's: at each step a twin
    optimizer with the same state takes the same gradients from the hooked parameters, and
    its update ``Delta`` gives ``w_old + r * Delta`` with ``r`` from hook_kinds.rms_ratio."""
    net = model()
    twin = copy.deepcopy(net)
    optimizer = make(net.parameters())
    hook = UpdateRMS(**rule)
    hook.attach(optimizer)
    plain = make(twin.parameters())
    expected: list[Tensor] = []
    expected_ratios, ratios = [], []
    for step in range(steps):
        optimizer.zero_grad()
        backward(net, step)
        with torch.no_grad():
            for mine, theirs in zip(net.parameters(), twin.parameters(), strict=True):
                theirs.copy_(mine)
                theirs.grad = mine.grad.clone()  # type: ignore[union-attr]
        olds = [p.detach().clone() for p in net.parameters()]
        plain.step()
        lr = plain.param_groups[0]["lr"]
        expected, step_ratios = [], []
        for old, theirs in zip(olds, twin.parameters(), strict=True):
            delta = theirs.detach() - old
            r = rms_ratio(old, -delta / lr, **rule)
            step_ratios.append(r)
            expected.append(old + r * delta)
        optimizer.step()
        expected_ratios.append(step_ratios)
        ratios.append(hook.last_ratios[0].tolist())
    return [p.detach() for p in net.parameters()], expected, ratios, expected_ratios


@RULES
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_many_steps_match_the_formula_in_float64(name: str, rule: str, rms: float) -> None:
    actual, expected, ratios, expected_ratios = twin_trajectory(
        OPTIMIZERS[name], 12, rule=rule, rms=rms
    )
    for param, reference in zip(actual, expected, strict=True):
        assert_close_rel(param, reference, 1e-12)
    torch.testing.assert_close(
        torch.tensor(ratios), torch.tensor(expected_ratios), rtol=1e-12, atol=0
    )


def test_the_clip_rule_both_clips_and_leaves_updates_alone_in_these_tests() -> None:
    _, _, ratios, _ = twin_trajectory(OPTIMIZERS["sgd-momentum"], 12, rule="clip", rms=0.5)
    flat = [r for step in ratios for r in step]
    assert any(r == 1.0 for r in flat)
    assert any(r < 1.0 for r in flat)


@RULES
def test_muon_groups_get_the_rule_and_its_adamw_groups_opt_out(rule: str, rms: float) -> None:
    muon = pytest.importorskip("pytorch_optimizer").Muon

    def make(params: Any) -> torch.optim.Optimizer:
        weights, biases = [], []
        for param in params:
            (weights if param.ndim == 2 else biases).append(param)
        return muon(
            [
                {"params": weights, "use_muon": True, "weight_decay": 0.1},
                {"params": biases, "use_muon": False, "update": False},
            ],
            lr=0.02,
        )

    net, twin = model(), model()
    optimizer = make(net.parameters())
    UpdateRMS(rule, rms).attach(optimizer)
    plain = make(twin.parameters())
    for step in range(8):
        for module in (net, twin):
            module.zero_grad()
        backward(net, step)
        with torch.no_grad():
            for mine, theirs in zip(net.parameters(), twin.parameters(), strict=True):
                theirs.copy_(mine)
                theirs.grad = mine.grad.clone()  # type: ignore[union-attr]
        olds = [p.detach().clone() for p in net.parameters()]
        optimizer.step()
        plain.step()
        for param, old, theirs in zip(net.parameters(), olds, twin.parameters(), strict=True):
            delta = theirs.detach() - old
            if param.ndim == 2:
                r = rms_ratio(old, -delta / 0.02, rule=rule, rms=rms)
                assert_close_rel(param.detach(), old + r * delta, 1e-12)
            else:
                assert torch.equal(param.detach(), theirs.detach())


def test_matching_sets_the_rms_of_muons_update_to_the_target() -> None:
    """Moonlight's aim, exactly: the applied update's RMS is lr * 0.2, whatever Newton-Schulz's
    accuracy."""
    muon = pytest.importorskip("pytorch_optimizer").Muon
    net = model()
    weights = [p for p in net.parameters() if p.ndim == 2]
    optimizer = muon([{"params": weights, "use_muon": True}], lr=0.02)
    UpdateRMS("match").attach(optimizer)
    for step in range(4):
        optimizer.zero_grad()
        backward(net, step)
        olds = [w.detach().clone() for w in weights]
        optimizer.step()
        for weight, old in zip(weights, olds, strict=True):
            delta = (weight.detach() - old).double()
            rms = delta.norm().item() / math.sqrt(delta.numel())
            assert rms == pytest.approx(0.02 * 0.2, rel=1e-12)


def test_clipping_matches_pytorch_optimizers_adafactor_with_its_own_clipping() -> None:
    """AdaFactor(clip_threshold=d) divides its update by max(1, RMS / d) before the learning
    rate (without momentum, parameter scaling or relative steps): AdaFactor without clipping
    and UpdateRMS("clip", d) is the same optimizer."""
    adafactor = pytest.importorskip("pytorch_optimizer").AdaFactor
    settings: dict[str, Any] = {
        "lr": 1e-2,
        "betas": (None, 0.999),
        "scale_parameter": False,
        "relative_step": False,
    }
    net, peer = model(), model()
    optimizer = adafactor(net.parameters(), clip_threshold=1e30, **settings)
    UpdateRMS("clip", 0.5).attach(optimizer)
    clipping = adafactor(peer.parameters(), clip_threshold=0.5, **settings)
    for step in range(12):
        for module, opt in ((net, optimizer), (peer, clipping)):
            opt.zero_grad()
            backward(module, step)
            opt.step()
    for actual, expected in zip(net.parameters(), peer.parameters(), strict=True):
        assert_close_rel(actual.detach(), expected.detach(), 1e-12)


# --- the rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "rms", "target", "expected"),
    [
        ("clip", 0.5, 1.0, 1.0),
        ("clip", 1.0, 1.0, 1.0),
        ("clip", 4.0, 1.0, 0.25),
        ("clip", 0.3, 0.1, 1 / 3),
        ("clip", 0.0, 1.0, 1.0),
        ("match", 0.5, 0.2, 0.4),
        ("match", 0.05, 0.2, 4.0),
        ("match", 0.0, 0.2, 1.0),
        ("clip", math.inf, 1.0, 0.0),
        ("match", math.inf, 0.2, 0.0),
    ],
    ids=[
        "clip-below",
        "clip-at",
        "clip-above",
        "clip-small-cap",
        "clip-zero",
        "match-down",
        "match-up",
        "match-zero",
        "clip-inf",
        "match-inf",
    ],
)
def test_rms_ratios_are_the_papers_factors(
    rule: Any, rms: float, target: float, expected: float
) -> None:
    ratio = rms_ratios(torch.tensor([rms], dtype=torch.float64), rule, target)
    assert ratio.item() == pytest.approx(expected, rel=1e-15)


def test_the_default_rms_is_each_rules_papers_value() -> None:
    assert UpdateRMS().target == 1.0
    assert UpdateRMS("match").target == 0.2
    assert UpdateRMS("match", 0.3).target == 0.3


def test_a_zero_update_and_zero_weights_keep_the_optimizers_result() -> None:
    still = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    still.grad = torch.zeros(4, 3, dtype=torch.float64)
    zero = nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    zero.grad = torch.randn(4, 3, dtype=torch.float64)
    before = still.detach().clone()
    optimizer = torch.optim.SGD([still, zero], lr=0.1)
    hook = UpdateRMS("match", 0.2)
    hook.attach(optimizer)
    grad = zero.grad.clone()
    optimizer.step()
    assert torch.equal(still.detach(), before)
    rms = grad.norm().item() / math.sqrt(grad.numel())
    assert_close_rel(zero.detach(), -0.1 * (0.2 / rms) * grad, 1e-12)
    assert hook.last_ratios[0].tolist() == pytest.approx([1.0, 0.2 / rms], rel=1e-12)


def test_groups_override_the_rule_and_rms_and_opt_out() -> None:
    params = [nn.Parameter(torch.randn(5, 4, dtype=torch.float64)) for _ in range(3)]
    grads = [3 * torch.randn(5, 4, dtype=torch.float64) for _ in params]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    olds = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(
        [
            {"params": params[:1], "update_rule": "match"},
            {"params": params[1:2], "update_rms": 0.25},
            {"params": params[2:], "update": False},
        ],
        lr=0.1,
    )
    UpdateRMS().attach(optimizer)
    optimizer.step()
    r0 = rms_ratio(olds[0], grads[0], rule="match", rms=0.2)
    r1 = rms_ratio(olds[1], grads[1], rule="clip", rms=0.25)
    assert r1 < 1.0
    assert_close_rel(params[0].detach(), olds[0] - 0.1 * r0 * grads[0], 1e-12)
    assert_close_rel(params[1].detach(), olds[1] - 0.1 * r1 * grads[1], 1e-12)
    assert torch.equal(params[2].detach(), olds[2].add(grads[2], alpha=-0.1))


def test_a_tensor_lr_is_read_without_a_host_sync() -> None:
    param = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    grad = torch.randn(5, 4, dtype=torch.float64)
    param.grad = grad.clone()
    old = param.detach().clone()
    optimizer = torch.optim.SGD([param], lr=torch.tensor(0.1, dtype=torch.float64))
    UpdateRMS("match", 0.2).attach(optimizer)
    optimizer.step()
    r = rms_ratio(old, grad, rule="match", rms=0.2)
    assert_close_rel(param.detach(), old - 0.1 * r * grad, 1e-12)


def test_a_closure_is_evaluated_once_by_the_hook() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    hook = UpdateRMS("clip", 0.1)
    hook.attach(optimizer)
    calls = []

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        backward(net, 0)
        return torch.zeros(())

    assert optimizer.step(closure) is not None
    assert calls == [True]
    assert len(hook.last_ratios[0]) == 4


# --- AMP -----------------------------------------------------------------------------------


def scaled_step(fused: bool, overflow: bool) -> tuple[nn.Module, list[Tensor], UpdateRMS]:
    net = model(torch.float32)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    hook = UpdateRMS("match", 0.2)
    hook.attach(optimizer)
    before = [p.detach().clone() for p in net.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(net(torch.randn(16, 5)).square().mean()).backward()
    if overflow:
        net[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
    scaler.step(optimizer)
    scaler.update()
    return net, before, hook


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_grad_scaler_skips_leaves_every_parameter_untouched(fused: bool) -> None:
    net, before, hook = scaled_step(fused, overflow=True)
    for param, old in zip(net.parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)
    assert [r.tolist() for r in hook.last_ratios] == ([[1.0] * 4] if fused else [])


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_grad_scaler_takes_has_the_target_rms(fused: bool) -> None:
    net, before, _ = scaled_step(fused, overflow=False)
    for param, old in zip(net.parameters(), before, strict=True):
        delta = (param.detach() - old).double()
        rms = delta.norm().item() / math.sqrt(delta.numel())
        assert rms == pytest.approx(1e-2 * 0.2, rel=1e-5)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rule": "scale"}, ValueError, r"rule must be 'clip' or 'match', got rule='scale'"),
        ({"rule": None}, TypeError, r"rule must be a str, 'clip' or 'match', got rule=None"),
        ({"rule": 1}, TypeError, r"rule must be a str, 'clip' or 'match', got rule=1"),
        ({"rule": ["clip"]}, TypeError, r"rule must be a str, .* got rule=\['clip'\]"),
        ({"rms": 0.0}, ValueError, r"rms must be positive, got rms=0.0"),
        ({"rms": -1.0}, ValueError, r"rms must be positive"),
        ({"rms": "big"}, TypeError, r"rms must be a real number, got rms='big'"),
        ({"rms": math.inf}, ValueError, r"rms must be finite"),
    ],
    ids=[
        "rule-unknown",
        "rule-none",
        "rule-int",
        "rule-list",
        "rms-0",
        "rms-negative",
        "rms-str",
        "rms-inf",
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        UpdateRMS(**kwargs)


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({"update_rule": "Clip"}, r"param group 0: update_rule must be 'clip' or 'match'"),
        ({"update_rms": 0}, r"param group 0: update_rms must be positive"),
        ({"update_threshold": 1.0}, r"param group 0: unknown key 'update_threshold'"),
        ({"lr": "0.1"}, r"UpdateRMS divides the update by the group's learning rate"),
    ],
    ids=["rule", "rms", "unknown-key", "lr"],
)
def test_bad_groups_are_refused_at_attach(group: dict[str, Any], match: str) -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.param_groups[0].update(group)
    with pytest.raises(ValueError, match=match):
        UpdateRMS().attach(optimizer)
    assert not optimizer._optimizer_step_pre_hooks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_parameters_are_refused(dtype: torch.dtype) -> None:
    optimizer = torch.optim.SGD(model(dtype).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=rf"is {dtype}; UpdateRMS needs float32 or float64"):
        UpdateRMS().attach(optimizer)
