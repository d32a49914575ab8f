"""A unit's record of its tensors between steps (``_step_hook.steady.Steady``): each part of its
rule changed under a record that holds, on the plain path and on the kernels' path.

The results are compared with LARS and gradient centralization written out here, not with
normhooks; whether the record held is read from its own check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from normhooks import (
    AdaptiveGradientClipping,
    GradientCentralization,
    GradientLARS,
    TrustRatio,
    _kernels,
)
from normhooks import _torch_compat as compat
from normhooks._step_hook import steady as steady_module
from normhooks._step_hook.steady import Steady

THRESHOLD, WEIGHT_DECAY, EPS = 1e-3, 0.1, 1e-9
SHAPES = [(3, 3), (5,), (2, 2, 3)]
CUDA = torch.cuda.is_available()
KERNELS = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter computes with NumPy, which warns at divisions in branches never taken.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def lars_by_hand(param: Tensor, grad: Tensor) -> Tensor:
    """arXiv:1708.03888, eq. 6, in float64: r (g + beta w), r = ||w|| / (||g|| + eps + beta ||w||)
    where ||w|| is above the threshold, 1 elsewhere."""
    w, g = param.detach().double(), grad.double()
    w_norm, g_norm = w.norm(), g.norm()
    rate = w_norm / (g_norm + EPS + WEIGHT_DECAY * w_norm) if w_norm > THRESHOLD else 1.0
    return (rate * (g + WEIGHT_DECAY * w)).to(grad.dtype)


def centralized_by_hand(grad: Tensor) -> Tensor:
    if grad.ndim < 2:
        return grad.clone()
    g = grad.double()
    return (g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True)).to(grad.dtype)


@contextlib.contextmanager
def no_kernels() -> Iterator[None]:
    yield


def kernel_path() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if CUDA else _kernels.route_cpu_tensors()


PATHS = [
    pytest.param(no_kernels, id="plain"),
    pytest.param(
        kernel_path,
        id="kernels",
        marks=pytest.mark.skipif(not KERNELS, reason="the kernels need CUDA or the interpreter"),
    ),
]


class Held:
    """Whether each unit's record held, at each time it was asked (Steady.bind), in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.outcomes: list[bool] = []
        original = Steady.bind

        def spying(steady: Steady, *args: Any) -> Any:
            bound = original(steady, *args)
            self.outcomes.append(bound is not None)
            return bound

        monkeypatch.setattr(Steady, "bind", spying)


def device() -> str:
    return "cuda" if CUDA else "cpu"


def new_grads(params: list[nn.Parameter]) -> None:
    for param in params:
        param.grad = torch.randn(param.shape, device=param.device, dtype=param.dtype)


def refilled(params: list[nn.Parameter]) -> None:
    """New values in the gradients' own memory, the addresses the record keeps (a new gradient
    where its parameter changed shape)."""
    for param in params:
        if param.grad is None or param.grad.shape != param.shape:
            param.grad = torch.randn(param.shape, device=param.device, dtype=param.dtype)
        else:
            param.grad.copy_(torch.randn(param.shape))


def steady_optimizer(hook: object) -> torch.optim.SGD:
    """SGD(lr=0) over SHAPES with ``hook``, after two steps: the first records its units, the
    second is served by the record."""
    params = [nn.Parameter(torch.randn(shape, device=device())) for shape in SHAPES]
    optimizer = torch.optim.SGD(params, lr=0.0)
    hook.attach(optimizer)  # type: ignore[attr-defined]
    for _ in range(2):
        new_grads(params)
        optimizer.step()
    return optimizer


def params_of(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return list(optimizer.param_groups[0]["params"])


def transposed_grad(params: list[nn.Parameter]) -> None:
    new_grads(params)
    params[0].grad = torch.randn(params[0].shape, device=params[0].device).t().contiguous().t()


class Subclass(Tensor):
    pass


def subclass_grad(params: list[nn.Parameter]) -> None:
    new_grads(params)
    params[1].grad = params[1].grad.as_subclass(Subclass)  # type: ignore[union-attr]


def requiring_grad(params: list[nn.Parameter]) -> None:
    new_grads(params)
    params[1].grad = params[1].grad.requires_grad_()  # type: ignore[union-attr]


def gradients_elsewhere(params: list[nn.Parameter]) -> list[Tensor]:
    # The old gradients stay alive, so the new ones cannot be given their memory.
    kept = [p.grad for p in params if p.grad is not None]
    new_grads(params)
    return kept


def moved(params: list[nn.Parameter]) -> None:
    params[2].data = params[2].data.clone()
    new_grads(params)


def transposed_in_place(params: list[nn.Parameter]) -> None:
    # The same memory and address, read with other strides.
    params[0].data = params[0].data.t()
    new_grads(params)


def reshaped_in_place(params: list[nn.Parameter]) -> None:
    params[2].data = params[2].data.view(2, 6)
    new_grads(params)


def converted(params: list[nn.Parameter]) -> None:
    params[1].data = params[1].data.double()
    new_grads(params)


def swapped(params: list[nn.Parameter]) -> None:
    torch.utils.swap_tensors(params[2], nn.Parameter(torch.randn(SHAPES[2], device=device())))
    new_grads(params)


def frozen(params: list[nn.Parameter]) -> None:
    params[1].requires_grad_(False)
    new_grads(params)


Change = Callable[[list[nn.Parameter]], object]
# Each part of Steady's rule changed under a record that holds, and whether it still holds.
CHANGES: dict[str, tuple[Change, bool]] = {
    "nothing but new values": (refilled, True),
    "new gradients": (new_grads, True),
    "new gradients at other addresses": (gradients_elsewhere, True),
    "a gradient set to None": (lambda ps: (new_grads(ps), setattr(ps[1], "grad", None)), False),
    "a gradient laid out otherwise": (transposed_grad, False),
    "a gradient of a tensor subclass": (subclass_grad, False),
    "a gradient requiring grad": (requiring_grad, False),
    "a parameter moved with .data": (moved, False),
    "a parameter transposed in its memory": (transposed_in_place, False),
    "a parameter reshaped in its memory": (reshaped_in_place, False),
    "a parameter converted with .data": (converted, False),
    "a parameter swapped with swap_tensors": (swapped, False),
    "a parameter's requires_grad turned off": (frozen, False),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_each_part_of_the_records_rule_changed_under_it(
    monkeypatch: pytest.MonkeyPatch,
    change: tuple[Change, bool],
    path: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    with path():
        optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
        params = params_of(optimizer)
        held = Held(monkeypatch)
        make_change, holds = change
        alive = make_change(params)
        wanted = {i: lars_by_hand(p, p.grad) for i, p in enumerate(params) if p.grad is not None}
        optimizer.step()
        del alive
    # The steady check first; a step that then takes the long way asks its record again.
    assert held.outcomes[0] is holds
    for i, grad in wanted.items():
        torch.testing.assert_close(params[i].grad, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_record_made_again_after_a_change_serves_the_steps_after_it(
    monkeypatch: pytest.MonkeyPatch, path: Callable[[], contextlib.AbstractContextManager[None]]
) -> None:
    with path():
        optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
        params = params_of(optimizer)
        held = Held(monkeypatch)
        moved(params)
        optimizer.step()
        for _ in range(2):
            new_grads(params)
            wanted = [lars_by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]
            optimizer.step()
    assert [held.outcomes[0], *held.outcomes[-2:]] == [False, True, True]
    for param, grad in zip(params, wanted, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)


def test_a_group_entry_edited_is_planned_again_the_long_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
    params = params_of(optimizer)
    held = Held(monkeypatch)
    optimizer.param_groups[0]["lars"] = False  # the group opts out
    new_grads(params)
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    optimizer.step()
    # The group's entries are compared before any record is read.
    assert held.outcomes == []
    for param, grad in zip(params, before, strict=True):
        torch.testing.assert_close(param.grad, grad)


@pytest.mark.skipif(not KERNELS, reason="the kernels need CUDA or the interpreter")
def test_the_kernels_table_kept_with_a_record_is_not_used_after_tables_are_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from normhooks._kernels import _multi

    with kernel_path():
        optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
        params = params_of(optimizer)
        made: list[int] = []
        original = _multi.table

        def counting(*args: Any, **kwargs: Any) -> Any:
            made.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(_multi, "table", counting)
        refilled(params)
        optimizer.step()
        assert made == [], "a steady step looked its table up"
        _multi.drop_tables()
        refilled(params)
        wanted = [lars_by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]
        optimizer.step()
    assert made == [1]
    for param, grad in zip(params, wanted, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not KERNELS, reason="the kernels need CUDA or the interpreter")
@pytest.mark.parametrize(
    "hook",
    [
        lambda: GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS),
        lambda: AdaptiveGradientClipping(0.01),
        lambda: GradientCentralization(),
    ],
    ids=["lars", "agc", "gc"],
)
def test_every_kernel_finds_its_table_with_the_record_at_a_steady_step(
    monkeypatch: pytest.MonkeyPatch, hook: Callable[[], object]
) -> None:
    from normhooks._kernels import _multi

    with kernel_path():
        optimizer = steady_optimizer(hook())
        params = params_of(optimizer)
        made: list[int] = []
        laid: list[int] = []
        table, laid_out = _multi.table, _multi.laid_out
        monkeypatch.setattr(_multi, "table", lambda *a, **k: made.append(1) or table(*a, **k))
        monkeypatch.setattr(_multi, "laid_out", lambda *a, **k: laid.append(1) or laid_out(*a, **k))
        held = Held(monkeypatch)
        refilled(params)
        optimizer.step()
    assert held.outcomes == [True]
    assert made == laid == []


@pytest.mark.parametrize("path", PATHS)
def test_gradient_centralization_chooses_again_when_its_setting_changes(
    path: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    with path():
        params = [nn.Parameter(torch.randn(s, device=device())) for s in [(3, 2, 2, 2), (4, 3)]]
        optimizer = torch.optim.SGD([{"params": params}], lr=0.0)
        GradientCentralization().attach(optimizer)
        for conv_only in (False, False, True, True, False):
            optimizer.param_groups[0]["gc_conv_only"] = conv_only
            new_grads(params)
            least = 4 if conv_only else 2
            wanted = [
                centralized_by_hand(p.grad) if p.ndim >= least else p.grad.clone()  # type: ignore[arg-type]
                for p in params
            ]
            optimizer.step()
            for param, grad in zip(params, wanted, strict=True):
                torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)


def test_a_unit_whose_tensors_change_at_every_step_stops_being_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hook = GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS)
    optimizer = steady_optimizer(hook)
    params = params_of(optimizer)
    taken: list[int] = []
    original = Steady.take.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Steady], *args: Any) -> Any:
        taken.append(1)
        return original(cls, *args)

    monkeypatch.setattr(Steady, "take", classmethod(counting))
    for step in range(10):
        # Every other step the first gradient comes laid out otherwise.
        transposed_grad(params) if step % 2 else new_grads(params)
        wanted = [lars_by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]
        optimizer.step()
        for param, grad in zip(params, wanted, strict=True):
            torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
    # The first step is served; each later one finds the last record unused and makes another,
    # until the unit is given up on.
    assert len(taken) == steady_module._MAX_MISSES + 1
    (unit,) = hook._plans[optimizer][0].units
    assert unit.steady is None


def test_without_a_layout_check_nothing_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "layout_check", lambda tensors: None)
    held = Held(monkeypatch)
    optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS))
    params = params_of(optimizer)
    new_grads(params)
    wanted = [lars_by_hand(p, p.grad) for p in params]  # type: ignore[arg-type]
    optimizer.step()
    assert held.outcomes == []
    for param, grad in zip(params, wanted, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)


# --- the check itself ----------------------------------------------------------------------


def test_the_layout_check_refuses_every_change_of_metadata_and_reads_no_address() -> None:
    param, grad = nn.Parameter(torch.randn(2, 3)), torch.randn(2, 3)
    check = compat.layout_check([param, grad])
    assert check is not None
    assert check(param, grad)
    # Other tensors of the same metadata, elsewhere in memory: addresses are not its concern.
    assert check(nn.Parameter(torch.randn(2, 3)), torch.randn(4, 3)[2:])
    for other in [
        torch.randn(2, 3, dtype=torch.float64),
        torch.randn(3, 2),
        torch.randn(3, 2).t(),
        torch.randn(2, 3).to_sparse(),
        torch.randn(2, 3, device="meta"),
        torch.randn(2, 3, requires_grad=True),
        torch.randn(2, 3)._neg_view(),
        torch.randn(2, 3).as_subclass(Subclass),
        nn.Parameter(torch.randn(2, 3)),
        None,
    ]:
        assert not check(param, other), other
    assert not check(torch.randn(2, 3), grad)


def test_the_layout_check_is_turned_off_where_it_would_miss_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A guard that compares nothing: the self-check sees it let a change through.
    monkeypatch.setattr(compat, "_tensor_guards", lambda tensors: lambda *others: True)
    compat._layout_check_works.cache_clear()
    try:
        assert compat.layout_check([torch.randn(2)]) is None
    finally:
        monkeypatch.undo()
        compat._layout_check_works.cache_clear()
    assert compat.layout_check([torch.randn(2)]) is not None


# --- the lr, which schedulers set at every step ---------------------------------------------


def lars_clipped_by_hand(param: Tensor, grad: Tensor, lr: float) -> Tensor:
    """LARC's clipping: the rate min(rate / lr, 1)."""
    w, g = param.detach().double(), grad.double()
    w_norm, g_norm = w.norm(), g.norm()
    rate = torch.clamp(w_norm / (g_norm + EPS + WEIGHT_DECAY * w_norm) / lr, max=1.0)
    return (torch.where(w_norm > THRESHOLD, rate, 1.0) * (g + WEIGHT_DECAY * w)).to(grad.dtype)


@pytest.mark.parametrize("path", PATHS)
def test_a_scheduler_setting_the_lr_at_every_step_keeps_the_steps_steady(
    monkeypatch: pytest.MonkeyPatch, path: Callable[[], contextlib.AbstractContextManager[None]]
) -> None:
    from normhooks._step_hook.plan import Planning

    with path():
        optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS, clip=True))
        params = params_of(optimizer)
        optimizer.param_groups[0]["lr"] = 0.5
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        # The scheduler adds "initial_lr" to the group: planned again once.
        new_grads(params)
        optimizer.step()
        scheduler.step()
        planned: list[int] = []
        original = Planning._new_plan
        monkeypatch.setattr(
            Planning, "_new_plan", lambda *args: planned.append(1) or original(*args)
        )
        held = Held(monkeypatch)
        for _ in range(3):
            new_grads(params)
            lr = optimizer.param_groups[0]["lr"]
            wanted = [lars_clipped_by_hand(p, p.grad, lr) for p in params]  # type: ignore[arg-type]
            optimizer.step()
            for param, grad in zip(params, wanted, strict=True):
                torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
            scheduler.step()
    assert planned == []
    assert held.outcomes == [True, True, True]


def test_an_lr_the_technique_refuses_is_refused_at_a_steady_step_and_nothing_changes() -> None:
    optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS, clip=True))
    params = params_of(optimizer)
    new_grads(params)
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    optimizer.param_groups[0]["lr"] = "0.1"
    with pytest.raises(ValueError, match=r"param group 0: clip=True divides by the group's"):
        optimizer.step()
    for param, grad in zip(params, before, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_an_lr_removed_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from normhooks._step_hook.plan import Planning

    optimizer = steady_optimizer(GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS, clip=True))
    planned: list[int] = []
    original = Planning._new_plan
    monkeypatch.setattr(Planning, "_new_plan", lambda *args: planned.append(1) or original(*args))
    lr = optimizer.param_groups[0].pop("lr")
    optimizer.param_groups[0]["extra"] = lr  # as many entries as planned
    with pytest.raises(ValueError, match=r"param group 0: clip=True divides"):
        optimizer.step()
    assert planned == [1]


# --- parameters without a gradient ------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_parameters_without_a_gradient_keep_the_steps_steady_until_one_gets_one(
    monkeypatch: pytest.MonkeyPatch, path: Callable[[], contextlib.AbstractContextManager[None]]
) -> None:
    with path():
        params = [nn.Parameter(torch.randn(shape, device=device())) for shape in SHAPES]
        frozen = nn.Parameter(torch.randn(2, 2, device=device()))
        # A group of only frozen parameters (a unit with no gradient at all), and one frozen
        # parameter among the others.
        optimizer = torch.optim.SGD(
            [
                {"params": [params[0], frozen, *params[1:]]},
                {"params": [nn.Parameter(torch.ones(3))]},
            ],
            lr=0.0,
        )
        GradientLARS(THRESHOLD, WEIGHT_DECAY, EPS).attach(optimizer)
        held = Held(monkeypatch)
        for step in range(4):
            new_grads(params)
            if step == 3:
                frozen.grad = torch.randn(2, 2, device=device())
            trained = [*params, frozen] if step == 3 else params
            wanted = [lars_by_hand(p, p.grad) for p in trained]  # type: ignore[arg-type]
            optimizer.step()
            for param, grad in zip(trained, wanted, strict=True):
                torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
            assert optimizer.param_groups[1]["params"][0].grad is None
            if step < 3:
                assert frozen.grad is None
    # Steps 1 and 2 served by the records (both units of each step); step 3's gradient on the
    # frozen parameter fails the first unit's record.
    assert held.outcomes[:5] == [True, True, True, True, False]


# --- an update hook: the trust ratio's copies under a record -----------------------------------


def trust_ratio_step_by_hand(old: Tensor, grad: Tensor, lr: float) -> Tensor:
    """SGD's update d = -lr g rescaled to lr ||w|| / ||d|| d (arXiv:1904.00962), in float64."""
    w, d = old.double(), -lr * grad.double()
    ratio = w.norm() / (d.norm() / lr)
    return (w + ratio * d).to(old.dtype)


def params_moved(params: list[nn.Parameter]) -> None:
    params[2].data = params[2].data.clone()


def params_reshaped(params: list[nn.Parameter]) -> None:
    params[2].data = params[2].data.view(2, 6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("change", "held"),
    [(lambda ps: None, True), (params_moved, False), (params_reshaped, False)],
    ids=["nothing", "a parameter moved", "a parameter reshaped in its memory"],
)
def test_the_trust_ratios_copies_are_made_again_where_the_record_does_not_hold(
    monkeypatch: pytest.MonkeyPatch,
    path: Callable[[], contextlib.AbstractContextManager[None]],
    change: Change,
    held: bool,
) -> None:
    from normhooks._step_hook import copies

    lr = 0.1
    with path():
        params = [nn.Parameter(torch.randn(shape, device=device())) for shape in SHAPES]
        optimizer = torch.optim.SGD(params, lr=lr)
        TrustRatio().attach(optimizer)
        for _ in range(2):
            new_grads(params)
            optimizer.step()
        from normhooks._kernels import _multi

        read: list[int] = []
        shapes = copies._shapes
        monkeypatch.setattr(copies, "_shapes", lambda ts: read.append(1) or shapes(ts))
        made: list[int] = []
        table = _multi.table
        monkeypatch.setattr(_multi, "table", lambda *a, **k: made.append(1) or table(*a, **k))
        change(params)
        refilled(params)  # the gradients where they were: the record's kept table stays
        wanted = [
            trust_ratio_step_by_hand(p.detach().clone(), p.grad, lr)  # type: ignore[arg-type]
            for p in params
        ]
        optimizer.step()
    for param, value in zip(params, wanted, strict=True):
        torch.testing.assert_close(param.detach(), value, rtol=1e-5, atol=1e-6)
    # The copies' shapes are read only where the record did not hold.
    assert bool(read) is not held
    if path is kernel_path:
        # The copy before the step finds its table with the record; the rescale after it,
        # past the optimizer's step, looks its own up.
        assert len(made) == (1 if held else 2)
