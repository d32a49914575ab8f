"""StepHook, the base of the step hooks, on a toy technique written the intended way.

``Scale`` multiplies every gradient by ``factor``: the whole subclass is its settings, a
prefix and a pure unit function, as AGC or gradient centralization is.
"""

from __future__ import annotations

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
