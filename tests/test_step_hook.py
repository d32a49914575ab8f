"""StepHook, the base of the step hooks, on a toy technique written the intended way.

``Scale`` multiplies every gradient by ``factor``: the whole subclass is its settings, a
prefix and a pure unit function, as AGC or gradient centralization is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from helpers import assert_grad_scaler_matches_unscaled
from normhooks import AdaptiveGradientClipping, GradientLARS
from normhooks._checks import positive
from normhooks._step_hook import Settings, StepHook, _Copies, setting


@dataclass(frozen=True, eq=False)
class ScaleSettings(Settings):
    factor: float = setting(positive)


def scale_unit_(
    params: list[Tensor],
    grads: list[Tensor],
    settings: ScaleSettings,
    lr: float | Tensor | None,
    *,
    norms: tuple[Tensor, Tensor] | None,
    foreach: bool | None,
    steady: object = None,
) -> Tensor:
    for grad in grads:
        grad.mul_(settings.factor)
    return torch.full((len(grads),), settings.factor)


class Scale(StepHook, ScaleSettings):
    prefix = "scale"
    technique = "gradient scaling"
    _unit_ = staticmethod(scale_unit_)

    def __init__(self, factor: float = 2.0, *, foreach: bool | None = None) -> None:
        super().__init__(factor=factor, foreach=foreach)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def test_groups_opt_out_and_override_with_the_prefix() -> None:
    first, second, third = (nn.Parameter(torch.ones(2)) for _ in range(3))
    for param in (first, second, third):
        param.grad = torch.ones(2)
    optimizer = torch.optim.SGD(
        [{"params": [first]}, {"params": [second], "scale_factor": 5.0}, {"params": [third]}],
        lr=0.0,
    )
    optimizer.param_groups[2]["scale"] = False
    hook = Scale(3.0)
    hook.attach(optimizer)
    optimizer.step()
    assert [p.grad.tolist() for p in (first, second, third)] == [[3, 3], [5, 5], [1, 1]]
    assert [v.tolist() for v in hook._last_values] == [[3.0], [5.0], []]


def test_unknown_key_and_bad_override_name_the_prefix() -> None:
    optimizer = torch.optim.SGD([{"params": model().parameters(), "scale_factr": 2.0}], lr=0.1)
    with pytest.raises(ValueError, match="param group 0: unknown key 'scale_factr'; expected "):
        Scale().attach(optimizer)
    optimizer = torch.optim.SGD([{"params": model().parameters(), "scale_factor": 0.0}], lr=0.1)
    with pytest.raises(ValueError, match="param group 0: scale_factor must be positive"):
        Scale().attach(optimizer)


def test_hooks_of_different_classes_share_an_optimizer() -> None:
    optimizer = torch.optim.SGD(model().parameters(), lr=0.1)
    Scale().attach(optimizer)
    GradientLARS().attach(optimizer)
    with pytest.raises(RuntimeError, match="another Scale"):
        Scale().attach(optimizer)


def test_grad_scaler_protocol_for_a_new_technique() -> None:
    """A unit function that knows nothing of GradScaler gets the base's AMP handling."""

    def make(fused: bool) -> Any:
        def build(m: nn.Module) -> torch.optim.Optimizer:
            groups = [
                {"params": [m[0].weight, m[2].weight]},
                {"params": [m[0].bias, m[2].bias], "scale": False},
            ]
            optimizer = torch.optim.Adam(groups, lr=1e-2, fused=fused)
            Scale(0.5).attach(optimizer)
            return optimizer

        return build

    assert_grad_scaler_matches_unscaled(
        model(), torch.randn(8, 4), make(True), make(False), rtol=1e-6, atol=1e-7
    )


def test_functional_form() -> None:
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    params[0].grad = torch.ones(3)
    values = Scale._apply_to_parameters_(params, ScaleSettings(4.0), None)
    assert values is not None
    assert values.tolist() == [4.0]
    assert params[0].grad.tolist() == [4.0] * 3
    assert params[1].grad is None


# --- found in review: each of these was silently wrong or left state behind ----------------


def test_an_error_in_a_later_hook_leaves_the_gradients_of_every_hook_unchanged() -> None:
    w, v = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    GradientLARS(weight_decay=0.1).attach(optimizer)
    AdaptiveGradientClipping().attach(optimizer)
    optimizer.add_param_group({"params": [v], "agc_clipping": -1.0})
    w.grad, v.grad = torch.ones(3, 3), torch.ones(3)
    with pytest.raises(ValueError, match="clipping must be positive"):
        optimizer.step()
    torch.testing.assert_close(w.grad, torch.ones(3, 3), rtol=0, atol=0)


def test_an_update_hooks_copy_goes_back_to_the_allocator_after_each_step_off_the_cpu() -> None:
    """Off the CPU a caching allocator keeps freed blocks: the copy's memory is released
    between steps (its storage resized to 0) and its views stay valid for the next."""
    tensors = [torch.randn(3, 4, device="meta"), torch.randn(5, device="meta")]
    copies = _Copies(tensors)
    views = copies.hold(tensors, None)
    storage = views[0].untyped_storage()
    assert storage.nbytes() == 17 * 4
    copies.release()
    assert storage.nbytes() == 0
    assert copies.hold(tensors, None) is views
    assert storage.nbytes() == 17 * 4
    assert [v.shape for v in views] == [(3, 4), (5,)]
    assert copies.fits([torch.empty(3, 4, device="meta"), torch.empty(5, device="meta")])
    assert not copies.fits([torch.empty(4, 3, device="meta"), torch.empty(5, device="meta")])
    assert not copies.fits([torch.empty(3, 4), torch.empty(5)])


# --- the plan kept between steps: each part of its validity rule, changed under it ----------


def planned(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.optim.SGD, list[int]]:
    """SGD(lr=0) over two float16 parameters in a group with ``"scale_factor": 3.0`` under a
    Scale(2), one step taken (so planned), and a list that grows each time the groups are
    planned again."""
    optimizer = torch.optim.SGD([{"params": [fresh(), fresh()], "scale_factor": 3.0}], lr=0.0)
    Scale(2.0).attach(optimizer)
    optimizer.step()
    calls: list[int] = []
    original = StepHook._new_plan

    def counting(self: StepHook, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepHook, "_new_plan", counting)
    return optimizer, calls


def fresh(dtype: torch.dtype = torch.float16) -> nn.Parameter:
    param = nn.Parameter(torch.ones(4, dtype=dtype))
    param.grad = torch.ones_like(param)
    return param


def swap_in(group: dict[str, Any]) -> None:
    torch.utils.swap_tensors(group["params"][0], fresh(torch.float32))


def read_as_bfloat16(group: dict[str, Any]) -> None:
    # The same memory read as another dtype of the same size: only the dtype tells.
    param = group["params"][0]
    param.data = param.data.view(torch.bfloat16)


Change = Callable[[torch.optim.Optimizer, dict[str, Any]], object]
# Each part of _GroupPlan's rule, changed under a plan that holds, with the factor that the
# first group's parameters get at the next step (Scale(2)'s own, or the group's override).
CHANGES: dict[str, tuple[Change, float]] = {
    "a group added": (lambda o, g: o.add_param_group({"params": [fresh()]}), 3.0),
    "a group replaced by a new dict": (
        lambda o, g: o.param_groups.__setitem__(0, {**g, "scale_factor": 5.0}),
        5.0,
    ),
    "an entry edited": (lambda o, g: g.__setitem__("scale_factor", 5.0), 5.0),
    "an entry added": (lambda o, g: g.__setitem__("scale", True), 3.0),
    "an entry removed": (lambda o, g: g.pop("scale_factor"), 2.0),
    "a parameter replaced by one over the same memory": (
        lambda o, g: g["params"].__setitem__(0, nn.Parameter(g["params"][0].data)),
        3.0,
    ),
    "a parameter appended": (lambda o, g: g["params"].append(fresh()), 3.0),
    "the parameters reordered": (lambda o, g: g["params"].reverse(), 3.0),
    "a parameter moved with .data": (
        lambda o, g: setattr(g["params"][0], "data", torch.ones(4, dtype=torch.float16)),
        3.0,
    ),
    "a parameter converted with .data": (
        lambda o, g: setattr(g["params"][0], "data", g["params"][0].data.float()),
        3.0,
    ),
    "a parameter swapped with swap_tensors": (lambda o, g: swap_in(g), 3.0),
    "a parameter read as another dtype in its memory": (lambda o, g: read_as_bfloat16(g), 3.0),
}


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_each_part_of_the_plans_rule_changed_under_it_is_noticed(
    monkeypatch: pytest.MonkeyPatch, change: tuple[Change, float]
) -> None:
    optimizer, calls = planned(monkeypatch)
    make_change, factor = change
    make_change(optimizer, optimizer.param_groups[0])
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    assert calls, "the step was served by the plan made before the change"
    first, *others = optimizer.param_groups
    assert [p.grad.tolist() for p in first["params"]] == [[factor] * 4] * len(first["params"])
    for group in others:
        assert [p.grad.tolist() for p in group["params"]] == [[2.0] * 4] * len(group["params"])


def test_a_plan_that_holds_is_not_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    optimizer, calls = planned(monkeypatch)
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)  # new gradient tensors, as zero_grad() leaves
    optimizer.step()
    assert calls == []
    assert [p.grad.tolist() for p in optimizer.param_groups[0]["params"]] == [[3.0] * 4] * 2


@pytest.mark.parametrize("new", [False, True], ids=["gone", "a new tensor"])
def test_gradients_are_read_at_each_step_under_a_plan_that_holds(
    monkeypatch: pytest.MonkeyPatch, new: bool
) -> None:
    optimizer, calls = planned(monkeypatch)
    first, second = optimizer.param_groups[0]["params"]
    first.grad = torch.full((4,), 2.0, dtype=torch.float16) if new else None
    second.grad = torch.ones_like(second)
    optimizer.step()
    assert calls == []
    assert second.grad.tolist() == [3.0] * 4
    if new:
        assert first.grad.tolist() == [6.0] * 4
    else:
        assert first.grad is None


def test_a_sparse_gradient_under_a_plan_that_holds_is_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    optimizer, _ = planned(monkeypatch)
    first, second = optimizer.param_groups[0]["params"]
    first.grad = torch.ones(4, dtype=torch.float16).to_sparse()
    second.grad = torch.ones_like(second)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 has a torch\.sparse_coo"):
        optimizer.step()
    assert second.grad.tolist() == [1.0] * 4
