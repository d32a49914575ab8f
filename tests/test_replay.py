"""A unit's launches replayed at a steady step (``Steady.replay``, ``_kernels._multi.Replay``):
each part of the replay's rule changed under it, on the kernels' path.

The results are compared with LARS, AGC and gradient centralization written out here, not with
normhooks; whether a step replayed is counted at the replay itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import normhooks
from normhooks import AdaptiveGradientClipping, GradientCentralization, GradientLARS, _kernels
from normhooks._step_hook.steady import Steady

THRESHOLD, WEIGHT_DECAY, EPS, CLIPPING, AGC_EPS = 1e-3, 0.1, 1e-9, 0.01, 1e-3
SHAPES = [(3, 3), (5,), (2, 2, 3)]
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.skipif(
        not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="the kernels need CUDA or the interpreter",
    ),
    # The interpreter computes with NumPy, which warns at divisions in branches never taken.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]


def lars_by_hand(param: Tensor, grad: Tensor, eps: float = EPS) -> Tensor:
    """arXiv:1708.03888, eq. 6, in float64: r (g + beta w), r = ||w|| / (||g|| + eps + beta ||w||)
    where ||w|| is above the threshold, 1 elsewhere."""
    w, g = param.detach().double(), grad.double()
    w_norm, g_norm = w.norm(), g.norm()
    rate = w_norm / (g_norm + eps + WEIGHT_DECAY * w_norm) if w_norm > THRESHOLD else 1.0
    return (rate * (g + WEIGHT_DECAY * w)).to(grad.dtype)


def agc_by_hand(param: Tensor, grad: Tensor) -> Tensor:
    """Brock et al. 2021, section 4.1, in float64: each row along dim 0 (a tensor of fewer than
    two dims whole) scaled to lambda max(||W_i||, eps) where its norm is above that."""
    w, g = param.detach().double(), grad.double()
    if w.ndim >= 2:
        dims = tuple(range(1, w.ndim))
        w_norm, g_norm = w.norm(dim=dims, keepdim=True), g.norm(dim=dims, keepdim=True)
    else:
        w_norm, g_norm = w.norm(), g.norm()
    bound = CLIPPING * w_norm.clamp(min=AGC_EPS)
    return (g * torch.where(g_norm > bound, bound / g_norm, 1.0)).to(grad.dtype)


def centralized_by_hand(param: Tensor, grad: Tensor) -> Tensor:
    if grad.ndim < 2:
        return grad.clone()
    g = grad.double()
    return (g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True)).to(grad.dtype)


HOOKS: dict[str, tuple[Callable[[], Any], Callable[[Tensor, Tensor], Tensor]]] = {
    "lars": (lambda: GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS), lars_by_hand),
    "agc": (lambda: AdaptiveGradientClipping(CLIPPING, AGC_EPS), agc_by_hand),
    "gc": (GradientCentralization, centralized_by_hand),
}


def kernel_path() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if CUDA else _kernels.route_cpu_tensors()


def device() -> str:
    return "cuda" if CUDA else "cpu"


class Replays:
    """How many units each step replayed (``_multi.Replay.__call__``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from normhooks._kernels import _multi

        self.count = 0
        original = _multi.Replay.__call__

        def counting(replay: Any, lr: Any) -> Any:
            self.count += 1
            return original(replay, lr)

        monkeypatch.setattr(_multi.Replay, "__call__", counting)


def refill(params: list[nn.Parameter]) -> None:
    """New values in the gradients' own memory (the addresses a record keeps)."""
    for param in params:
        assert param.grad is not None
        param.grad.copy_(torch.randn(param.shape))


def warmed(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, hook: Any
) -> torch.optim.Optimizer:
    """``optimizer`` over ``params`` with ``hook``, after three steps on the kernels: the first
    records each unit, the second runs its function under the record and keeps the replay,
    the third replays it."""
    for param in params:
        param.grad = torch.randn_like(param)
    hook.attach(optimizer)
    with kernel_path():
        for _ in range(3):
            refill(params)
            optimizer.step()
    return optimizer


def steady_optimizer(hook: Any) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """SGD(lr=0) over SHAPES with ``hook``, :func:`warmed`."""
    params = [nn.Parameter(torch.randn(shape, device=device())) for shape in SHAPES]
    return warmed(params, torch.optim.SGD(params, lr=0.0), hook), params


def wanted_of(
    params: list[nn.Parameter], by_hand: Callable[[Tensor, Tensor], Tensor]
) -> list[Tensor]:
    return [by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]


def assert_rewritten(params: list[nn.Parameter], wanted: list[Tensor]) -> None:
    for param, grad in zip(params, wanted, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_steady_step_replays_each_units_launches(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    make, by_hand = HOOKS[name]
    hook = make()
    optimizer, params = steady_optimizer(hook)
    replays = Replays(monkeypatch)
    for _ in range(2):
        refill(params)
        wanted = wanted_of(params, by_hand)
        with kernel_path():
            optimizer.step()
        assert_rewritten(params, wanted)
    assert replays.count == 2
    if name != "gc":  # the values of the last step, in parameter order
        (values,) = hook._last_values
        assert values.shape == (len(params),)


def _tables_dropped(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    from normhooks._kernels import _multi

    _multi.drop_tables()
    return kernel_path()


def _kernels_off(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    stack = contextlib.ExitStack()
    stack.enter_context(kernel_path())
    stack.enter_context(normhooks.set_kernels_enabled(False))
    return stack


def _not_routed(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    if CUDA:
        pytest.skip("CUDA tensors are not routed")
    return contextlib.nullcontext()


def _gradients_moved(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    params = optimizer.param_groups[0]["params"]
    old = [p.grad for p in params]  # kept alive: the new ones cannot take their memory
    for param in params:
        param.grad = torch.randn_like(param)
    stack = contextlib.ExitStack()
    stack.enter_context(kernel_path())
    stack.callback(old.clear)
    return stack


# What changes before the step, as a context to take the step in; every one of them must make
# the step run the unit function (and the formula where the kernels may not run).
CHANGES: dict[str, Callable[[torch.optim.Optimizer], contextlib.AbstractContextManager[None]]] = {
    "the tables dropped": _tables_dropped,
    "the kernels switched off": _kernels_off,
    "CPU tensors outside the routing": _not_routed,
    "the gradients moved": _gradients_moved,
}


@pytest.mark.parametrize("name", list(HOOKS))
@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_each_part_of_the_replays_rule_changed_under_it(
    monkeypatch: pytest.MonkeyPatch, name: str, change: Callable[..., Any]
) -> None:
    make, by_hand = HOOKS[name]
    optimizer, params = steady_optimizer(make())
    replays = Replays(monkeypatch)
    refill(params)
    with change(optimizer):
        wanted = wanted_of(params, by_hand)
        optimizer.step()
    assert replays.count == 0
    assert_rewritten(params, wanted)


def test_a_setting_edited_is_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's entries fail the plan's rule first: the plan and its settings are made
    again (the replay's own check of the settings object is tested on its own, below)."""
    optimizer, params = steady_optimizer(HOOKS["lars"][0]())
    replays = Replays(monkeypatch)
    optimizer.param_groups[0]["lars_eps"] = 1e-2
    refill(params)
    wanted = [lars_by_hand(p, p.grad, eps=1e-2) for p in params]  # type: ignore[arg-type]
    with kernel_path():
        optimizer.step()
    assert replays.count == 0
    assert_rewritten(params, wanted)


def test_a_step_with_a_closure_is_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, params = steady_optimizer(HOOKS["agc"][0]())
    replays = Replays(monkeypatch)
    grads = [torch.randn(p.shape) for p in params]

    def closure() -> Tensor:
        for param, grad in zip(params, grads, strict=True):
            assert param.grad is not None
            param.grad.copy_(grad)
        return torch.zeros(())

    wanted = [agc_by_hand(p, g) for p, g in zip(params, grads, strict=True)]
    with kernel_path():
        optimizer.step(closure)
    assert replays.count == 0
    assert_rewritten(params, wanted)


@pytest.mark.skipif(CUDA, reason="GradScaler on the CPU, with the CPU routed")
def test_a_step_under_gradscaler_is_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay writes what it wrote for unscaled gradients: under GradScaler's fused
    protocol the unit function must unscale them."""
    params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = torch.optim.Adam(params, lr=0.0, fused=True)
    warmed(params, optimizer, GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
    with kernel_path():
        replays = Replays(monkeypatch)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.zeros(()))  # the scale is made at the first scale()
        true_grads = [torch.randn(p.shape) for p in params]
        for param, grad in zip(params, true_grads, strict=True):
            assert param.grad is not None
            param.grad.copy_(grad * 4.0)
        wanted = [lars_by_hand(p, g) for p, g in zip(params, true_grads, strict=True)]
        scaler.step(optimizer)
    assert replays.count == 0
    assert_rewritten(params, wanted)


def test_a_failing_replay_raises_rather_than_compute_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Other units may be done when one fails: the formula must not run over them again."""
    from normhooks._kernels import _multi

    optimizer, params = steady_optimizer(HOOKS["lars"][0]())

    def failing(lr: Any) -> Tensor:
        raise _multi.KernelFailedError(RuntimeError("the device is gone"))

    (plan,) = optimizer_plans(optimizer)
    (unit,) = plan.units
    replay = unit.steady.replay[2]
    monkeypatch.setattr(replay, "_launch", failing)
    refill(params)
    with kernel_path(), pytest.raises(RuntimeError, match="the device is gone"):
        optimizer.step()


def optimizer_plans(optimizer: torch.optim.Optimizer) -> list[Any]:
    hook = next(iter(optimizer._optimizer_step_pre_hooks.values())).__self__
    return list(hook._plans[optimizer])


class _Replayable:
    def __init__(self, holds: bool) -> None:
        self._holds = holds

    def holds(self) -> bool:
        return self._holds

    def __call__(self, lr: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("settings_same", "lr", "holds", "found"),
    [
        (True, 0.1, True, True),
        (True, 0.2, True, True),  # a new float: a scheduler's
        (False, 0.1, True, False),  # a plan made again, with new settings
        (True, torch.tensor(0.1), True, False),  # an lr of another kind
        (True, None, True, False),
        (True, 0.1, False, False),  # the replay's own conditions
    ],
    ids=["same", "new-float-lr", "new-settings", "tensor-lr", "no-lr", "replay-fails-its-check"],
)
def test_a_replay_is_found_for_the_settings_and_the_kind_of_lr_it_was_made_under(
    settings_same: bool, lr: Any, holds: bool, found: bool
) -> None:
    record = Steady(lambda *tensors: True, [], [], [], ())
    settings = object()
    replay = _Replayable(holds)
    record.kept["replay"] = replay
    record.keep_replay(settings, 0.1)
    assert "replay" not in record.kept
    got = record.replay_for(settings if settings_same else object(), lr)
    assert (got is replay) is found


def _data_moved(params: list[nn.Parameter]) -> None:
    params[0].data = params[0].data.clone()


def _data_transposed(params: list[nn.Parameter]) -> None:
    params[0].data = params[0].data.t().contiguous().t()


def _swapped(params: list[nn.Parameter]) -> None:
    torch.utils.swap_tensors(params[2], nn.Parameter(params[2].detach().clone()))


PARAMETER_CHANGES: dict[str, Callable[[list[nn.Parameter]], None]] = {
    "a parameter moved by .data": _data_moved,
    "a parameter transposed in its memory": _data_transposed,
    "a parameter swapped with swap_tensors": _swapped,
}


@pytest.mark.parametrize("change", list(PARAMETER_CHANGES.values()), ids=list(PARAMETER_CHANGES))
def test_a_parameter_changed_under_a_replay_is_not_replayed(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[list[nn.Parameter]], None]
) -> None:
    """The record fails, so the step takes the unit function (and records again)."""
    optimizer, params = steady_optimizer(HOOKS["lars"][0]())
    replays = Replays(monkeypatch)
    change(params)
    for param in params:
        if param.grad is None:
            param.grad = torch.randn_like(param)
    refill(params)
    wanted = wanted_of(params, lars_by_hand)
    with kernel_path():
        optimizer.step()
    assert replays.count == 0
    assert_rewritten(params, wanted)


@pytest.mark.parametrize("name", ["lars", "agc"])
def test_a_parameter_laid_out_unlike_its_gradient_is_not_replayed(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The kernels read such a parameter through a contiguous copy made for the call, which a
    replay would read again after it is freed; its values change between steps (in place,
    under the record)."""
    make, by_hand = HOOKS[name]
    params = [nn.Parameter(torch.randn(4, 3, device=device()).t()) for _ in range(2)]
    for param in params:
        param.grad = torch.randn(param.shape, device=device())
    optimizer = torch.optim.SGD(params, lr=0.0)
    make().attach(optimizer)
    replays = Replays(monkeypatch)
    with kernel_path():
        for _ in range(4):
            with torch.no_grad():
                for param in params:
                    param.mul_(1.5)
            refill(params)
            wanted = wanted_of(params, by_hand)
            optimizer.step()
            assert_rewritten(params, wanted)
    assert replays.count == 0


def test_a_unit_with_nothing_to_centralize_replays_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of biases (no gradient of two or more dims) beside one of weights: every unit
    replays, the biases' doing nothing."""
    weights = [nn.Parameter(torch.randn(3, 4, device=device()))]
    biases = [nn.Parameter(torch.randn(3, device=device()).double())]
    params = [*weights, *biases]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.0)
    warmed(params, optimizer, GradientCentralization())
    with kernel_path():
        replays = Replays(monkeypatch)
        ran: list[int] = []
        unit = GradientCentralization._unit_

        def counting(*args: Any, **kwargs: Any) -> Any:
            ran.append(1)
            return unit(*args, **kwargs)

        monkeypatch.setattr(GradientCentralization, "_unit_", staticmethod(counting))
        refill(params)
        wanted = wanted_of(params, centralized_by_hand)
        optimizer.step()
    # The weights' launches replayed, the biases' nothing; no unit function ran.
    assert (replays.count, ran) == (1, [])
    assert_rewritten(params, wanted)


def lars_rate_by_hand(param: Tensor, grad: Tensor, lr: float | None = None) -> float:
    """The rate of :func:`lars_by_hand`, and with ``lr`` LARC's clipping, min(rate / lr, 1)."""
    w, g = param.detach().double(), grad.double()
    w_norm, g_norm = w.norm(), g.norm()
    rate = float(w_norm / (g_norm + EPS + WEIGHT_DECAY * w_norm)) if w_norm > THRESHOLD else 1.0
    return rate if lr is None else min(rate / lr, 1.0)


def test_a_replay_reads_the_tensor_lr_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """LARC's clipping with a tensor lr: the launches read the lr tensor of this step, a new
    one included."""
    params = [nn.Parameter(torch.randn(shape, device=device())) for shape in SHAPES]
    optimizer = torch.optim.SGD([{"params": params, "lars_clip": True}], lr=torch.tensor(0.5))
    hook = GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS)
    warmed(params, optimizer, hook)
    with kernel_path():
        replays = Replays(monkeypatch)
        for lr in (torch.tensor(0.05), torch.tensor(0.002)):
            optimizer.param_groups[0]["lr"] = lr
            refill(params)
            rates = [lars_rate_by_hand(p, p.grad, float(lr)) for p in params]  # type: ignore[arg-type]
            wanted = [
                r * (p.grad.double() + WEIGHT_DECAY * p.detach().double())
                for r, p in zip(rates, params, strict=True)
            ]  # type: ignore[union-attr]
            optimizer.step()
            assert_rewritten(params, [w.float() for w in wanted])
            torch.testing.assert_close(
                hook.last_rates[0].double(),
                torch.tensor(rates, dtype=torch.float64),
                rtol=1e-5,
                atol=0,
            )
    assert replays.count == 2


def test_the_values_of_several_units_come_back_in_parameter_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group whose float32 and float64 parameters make two units, interleaved."""
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64]
    params = [nn.Parameter(torch.randn(3, 2, device=device(), dtype=d)) for d in dtypes]
    hook = GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS)
    optimizer = warmed(params, torch.optim.SGD(params, lr=0.0), hook)
    with kernel_path():
        replays = Replays(monkeypatch)
        refill(params)
        rates = [lars_rate_by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]
        optimizer.step()
    assert replays.count == 2
    torch.testing.assert_close(
        hook.last_rates[0].double(), torch.tensor(rates, dtype=torch.float64), rtol=1e-5, atol=0
    )
